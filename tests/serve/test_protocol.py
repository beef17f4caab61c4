"""Request parsing without Ray: a chat template's own refusal is the client's 400."""
import pytest
from transformers import AutoTokenizer

from keyacc_ray.errors import InvalidRequest
from keyacc_ray.serve.protocol import logprobs_body, parse


def test_chat_template_refusal_is_an_invalid_request(qwen3_path):
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    body = {"model": "m", "messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]}
    ok = parse(body, "chat", tokenizer=tok, served_names={"m"}, max_model_len=256)
    assert ok.request.params["max_tokens"] == 256 - len(ok.request.prompt_token_ids)
    # as Gemma's template does for a system message
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(InvalidRequest, match="System role not supported") as e:
        parse(body, "chat", tokenizer=tok, served_names={"m"}, max_model_len=256)
    assert e.value.param == "messages"


def _parse(tok, kind, **extra):
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}),
            **extra}
    return parse(body, kind, tokenizer=tok, served_names={"m"}, max_model_len=256).request.params["logprobs"]


def test_logprobs_parameters(qwen3_path):
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    assert _parse(tok, "completion") is None
    assert _parse(tok, "completion", logprobs=None) is None
    assert _parse(tok, "completion", logprobs=0) == 0
    assert _parse(tok, "completion", logprobs=5) == 5
    assert _parse(tok, "chat") is None
    assert _parse(tok, "chat", logprobs=False) is None
    assert _parse(tok, "chat", logprobs=True) == 0
    assert _parse(tok, "chat", logprobs=True, top_logprobs=4) == 4
    assert _parse(tok, "chat", logprobs=False, top_logprobs=0) is None
    for kind, extra, param in (("completion", {"logprobs": 21}, "logprobs"), ("completion", {"logprobs": True}, "logprobs"),
                               ("chat", {"logprobs": 3}, "logprobs"), ("chat", {"top_logprobs": 2}, "top_logprobs"),
                               ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(InvalidRequest) as e:
            _parse(tok, kind, **extra)
        assert e.value.param == param, (kind, extra)


def test_logprobs_bodies():
    text = {5: "a", 6: "bc", 7: "é"}.__getitem__
    lps = [(-0.5, [(5, -0.5), (7, -1.5)]), (-2.0, [(5, -0.1), (6, -2.0)])]
    chat = logprobs_body("chat", [5, 6], lps, text)
    assert chat == {"content": [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "é", "logprob": -1.5, "bytes": [195, 169]}]},
        {"token": "bc", "logprob": -2.0, "bytes": [98, 99], "top_logprobs": [
            {"token": "a", "logprob": -0.1, "bytes": [97]}, {"token": "bc", "logprob": -2.0, "bytes": [98, 99]}]}]}
    cmpl = logprobs_body("completion", [5, 6], lps, text, text_offset=3)
    assert cmpl == {"tokens": ["a", "bc"], "token_logprobs": [-0.5, -2.0],
                    "top_logprobs": [{"a": -0.5, "é": -1.5}, {"a": -0.1, "bc": -2.0}], "text_offset": [3, 4]}
    assert logprobs_body("chat", [5], None, text) is None
