"""Request parsing without Ray: a chat template's own refusal is the client's 400."""
import pytest
from transformers import AutoTokenizer

from keyacc_ray.errors import InvalidRequest
from keyacc_ray.serve.protocol import parse


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
