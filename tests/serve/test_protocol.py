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


def _choices(tok, kind="completion", **body):
    body = {"model": "m", **body}
    return parse(body, kind, tokenizer=tok, served_names={"m"}, max_model_len=256)


def test_batched_prompts_and_n_make_one_request_per_choice(qwen3_path):
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    p = _choices(tok, prompt=["hello there", [5, 6, 7]], n=2, seed=11, max_tokens=4)
    first = tok("hello there")["input_ids"]
    # prompt-major, then n (vLLM's order); ids unique (each is a request of its own in the graph)
    assert [r.prompt_token_ids for r in p.requests] == [first, first, [5, 6, 7], [5, 6, 7]]
    assert len({r.request_id for r in p.requests}) == 4
    assert all(r.request_id.startswith(p.response_id + "-") for r in p.requests)
    # the n samples of one prompt differ (seed + j), each prompt's first keeps the client's seed
    assert [r.params["seed"] for r in p.requests] == [11, 12, 11, 12]
    assert p.num_prompt_tokens == len(first) + 3  # usage counts each prompt once, whatever n is
    one = _choices(tok, prompt=["just one"])  # a batch of one is a plain request
    assert len(one.requests) == 1 and one.request.request_id == one.response_id
    assert _choices(tok, prompt="x", n=3, best_of=3).request.params["seed"] is None
    # cached prompt tokens count each prompt once too: the most any of its choices found cached
    from keyacc_ray.serve.protocol import cached_tokens, usage
    assert cached_tokens(p, [0, 16, 0, 0]) == 16 and cached_tokens(p, [32, 16, 0, 48]) == 80
    assert usage(10, 4, 8) == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                               "prompt_tokens_details": {"cached_tokens": 8}}


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": "2"}, "n"), ({"prompt": "x", "n": 65}, "n"),
    ({"prompt": ["x"] * 33, "n": 2}, "n"), ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": ["x", ""]}, "prompt"), ({"prompt": ["x", 5]}, "prompt"), ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": ["x", "word " * 300]}, "prompt"), ({"prompt": [[1, 2], [10 ** 9]]}, "prompt"),
])
def test_bad_choices_are_refused(qwen3_path, body, param):
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    with pytest.raises(InvalidRequest) as e:
        _choices(tok, **body)
    assert e.value.param == param


def test_null_fields_as_clients_send_them(qwen3_path):
    """Clients that serialise every field send unset ones as null: a null max_completion_tokens
    must not hide max_tokens, and an assistant turn may carry no content (OpenAI's rule)."""
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    msgs = [{"role": "user", "content": "hi"}]
    p = _choices(tok, "chat", messages=msgs, max_tokens=5, max_completion_tokens=None)
    assert p.request.params["max_tokens"] == 5
    assert _choices(tok, "chat", messages=msgs, max_tokens=5, max_completion_tokens=7).request.params["max_tokens"] == 7
    turns = msgs + [{"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    empty = msgs + [{"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]
    assert (_choices(tok, "chat", messages=turns).request.prompt_token_ids
            == _choices(tok, "chat", messages=empty).request.prompt_token_ids)
    with pytest.raises(InvalidRequest) as e:
        _choices(tok, "chat", messages=[{"role": "user", "content": None}])
    assert e.value.param == "messages[0].content"


def test_text_content_parts_join_as_vllm(qwen3_path):
    """OpenAI clients may send content as a list of parts: text parts join with newlines (vLLM's
    rule for string-content templates), anything else is refused."""
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    joined = [{"role": "user", "content": "one\ntwo"}]
    assert (_choices(tok, "chat", messages=parts).request.prompt_token_ids
            == _choices(tok, "chat", messages=joined).request.prompt_token_ids)
    with pytest.raises(InvalidRequest) as e:
        _choices(tok, "chat", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.value.param == "messages[0].content"


def test_echo_parsing_and_what_each_choice_sends(qwen3_path):
    from keyacc_ray.serve.messages import TokenChunk
    from keyacc_ray.serve.protocol import as_sent

    tok = AutoTokenizer.from_pretrained(qwen3_path)
    p = _choices(tok, prompt=["hello there", [5, 6, 7]], echo=True, logprobs=2, n=2)
    assert p.echo == ["hello there", "hello there", tok.decode([5, 6, 7]), tok.decode([5, 6, 7])]
    assert all(r.params["prompt_logprobs"] == 2 for r in p.requests) and not p.echo_only
    scores = [None, (-1.0, [(9, -0.5)]), (-2.0, [(4, -0.1)])]
    first = TokenChunk([8], "x", None, 3, 1, [(-0.3, [(8, -0.3)])], scores)
    text, covered, entries, generated = as_sent(p, 2, first, True)
    assert (text, covered, generated) == (tok.decode([5, 6, 7]) + "x", [5, 6, 7, 8], [8])
    assert entries == scores + [(-0.3, [(8, -0.3)])]
    later = TokenChunk([9], "y", "length", 3, 2, [(-0.2, [])])
    assert as_sent(p, 2, later, False) == ("y", [9], [(-0.2, [])], [9])
    # max_tokens 0: only with echo; the engine makes one token, which is dropped
    only = _choices(tok, prompt=[5, 6, 7], echo=True, max_tokens=0)
    assert only.echo_only and only.request.params["max_tokens"] == 1
    assert only.request.params["prompt_logprobs"] is None
    assert as_sent(only, 0, first, True) == (tok.decode([5, 6, 7]), [5, 6, 7], None, [])
    for body, param in (({"prompt": "hi", "max_tokens": 0}, "max_tokens"), ({"prompt": "hi", "echo": 1}, "echo")):
        with pytest.raises(InvalidRequest) as e:
            _choices(tok, **body)
        assert e.value.param == param
    with pytest.raises(InvalidRequest) as e:
        _choices(tok, "chat", messages=[{"role": "user", "content": "hi"}], echo=True)
    assert e.value.param == "echo"
    assert _choices(tok, prompt="hi", echo=False).echo is None


def test_tokenizer_endpoints(qwen3_path):
    from keyacc_ray.errors import KeyaccError
    from keyacc_ray.serve.protocol import detokenize, tokenize, tokenizer_info

    tok = AutoTokenizer.from_pretrained(qwen3_path)
    kw = {"tokenizer": tok, "served_names": {"m"}}
    out = tokenize({"prompt": "hello there", "add_special_tokens": False}, max_model_len=256, **kw)
    assert out["tokens"] == tok("hello there", add_special_tokens=False)["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    msgs = [{"role": "user", "content": "hi"}]
    chat = tokenize({"model": "m", "messages": msgs}, max_model_len=256, **kw)
    assert chat["tokens"] == _choices(tok, "chat", messages=msgs).request.prompt_token_ids
    assert detokenize({"tokens": out["tokens"]}, vocab_size=len(tok), **kw) == {"prompt": "hello there"}
    info = tokenizer_info(tok, len(tok))
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    for call, body, param in ((tokenize, {"prompt": 5}, "prompt"), (tokenize, {"prompt": "x", "model": "z"}, "model"),
                              (detokenize, {"tokens": [1, -2]}, "tokens"), (detokenize, {"tokens": "ab"}, "tokens"),
                              (detokenize, {"tokens": [len(tok)]}, "tokens")):
        with pytest.raises(KeyaccError) as e:  # a 400, or a 404 for another model
            call(body, **kw, **({"max_model_len": 256} if call is tokenize else {"vocab_size": len(tok)}))
        assert e.value.param == param


def test_generation_config_defaults_fill_what_a_request_leaves_out(qwen3_path, tmp_path):
    """vLLM's --generation-config auto: the model's generation_config.json sampling fields are the
    defaults; a request's own values (null meaning unset) win; max_new_tokens is the default
    max_tokens only; a value this server would refuse is dropped."""
    import json
    import shutil

    from keyacc_ray.serve.protocol import generation_defaults

    model = tmp_path / "m"
    shutil.copytree(qwen3_path, model)
    gc = json.loads((model / "generation_config.json").read_text())
    gc.update(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05, repetition_penalty=1.1, max_new_tokens=30,
              do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(gc))
    assert generation_defaults(qwen3_path) == {}  # the repo's tiny model ships none
    d = generation_defaults(str(model))
    assert d == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
                 "max_tokens": 30}
    tok = AutoTokenizer.from_pretrained(qwen3_path)

    def params(kind="completion", **body):
        msgs = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
        return parse({"model": "m", **msgs, **body}, kind, tokenizer=tok, served_names={"m"},
                     max_model_len=256, defaults=d).request.params

    p = params()
    assert (p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["repetition_penalty"]) == (0.6, 20, 0.95, 0.05, 1.1)
    assert p["max_tokens"] == 16  # the completions default is smaller
    assert params("chat")["max_tokens"] == 30  # instead of the rest of the context
    p = params(temperature=0, top_k=None, repetition_penalty=1.0, max_tokens=100, min_p=0)
    assert (p["temperature"], p["top_k"], p["repetition_penalty"], p["max_tokens"], p["min_p"]) == (0, 20, 1.0, 100, 0)
    assert parse({"model": "m", "prompt": "hi"}, "completion", tokenizer=tok, served_names={"m"},
                 max_model_len=256).request.params["repetition_penalty"] == 1.0  # no defaults: neutral
    with pytest.raises(InvalidRequest) as e:
        params(min_p=2)
    assert e.value.param == "min_p"
    gc.update(top_p=0.0, temperature=5.0)  # refused in a request: not taken as defaults either
    (model / "generation_config.json").write_text(json.dumps(gc))
    assert "top_p" not in generation_defaults(str(model)) and "temperature" not in generation_defaults(str(model))


def test_vllm_chat_options_and_refused_extensions(qwen3_path):
    """vLLM's chat options (add_generation_prompt, continue_final_message, chat_template_kwargs,
    add_special_tokens) reach the template; vLLM extensions this server does not implement are
    refused by name, never ignored."""
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]

    def ids(**body):
        return _choices(tok, "chat", messages=msgs, **body).request.prompt_token_ids

    def want(text_kw, **tok_kw):
        return tok(tok.apply_chat_template(msgs, tokenize=False, **text_kw), add_special_tokens=False, **tok_kw)["input_ids"]

    assert ids() == want({"add_generation_prompt": True})
    assert ids(add_generation_prompt=False) == want({"add_generation_prompt": False})
    cont = ids(add_generation_prompt=False, continue_final_message=True)
    assert cont == want({"add_generation_prompt": False, "continue_final_message": True})
    assert tok.decode(cont).endswith("hel")  # the assistant's turn left open
    with pytest.raises(InvalidRequest):
        ids(continue_final_message=True)  # with a generation prompt too
    tok.chat_template = "{{ greeting | default('') }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert tok.decode(ids(chat_template_kwargs={"greeting": "Hey"})) == "Hey[hi][hel]"
    tok.chat_template = "{% for m in messages %}{{ m.get('name', '?') }}:{{ m['content'] }};{% endfor %}"
    named = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]
    assert tok.decode(_choices(tok, "chat", messages=named).request.prompt_token_ids) == "ann:hi;?:yo;"
    for bad in ({"tokenize": True}, {"messages": []}, "x"):
        with pytest.raises(InvalidRequest) as e:
            ids(chat_template_kwargs=bad)
        assert e.value.param == "chat_template_kwargs"
    p = _choices(tok, prompt="hi", include_stop_str_in_output=True, skip_special_tokens=False).request.params
    assert p["include_stop_str_in_output"] is True and p["skip_special_tokens"] is False
    for body in ({"use_beam_search": True}, {"functions": [{"name": "f"}]}, {"allowed_token_ids": [1]},
                 {"chat_template": "{{ x }}"}, {"spaces_between_special_tokens": False}, {"truncate_prompt_tokens": 5}):
        with pytest.raises(InvalidRequest) as e:
            _choices(tok, prompt="hi", **body)
        assert e.value.param == next(iter(body)) and e.value.code == "unsupported_parameter"
    assert _choices(tok, prompt="hi", use_beam_search=False, length_penalty=1.0, bad_words=[]).request


def test_prompt_logprobs_parsing_and_body(qwen3_path):
    from keyacc_ray.serve.protocol import prompt_logprobs_body

    tok = AutoTokenizer.from_pretrained(qwen3_path)
    assert _choices(tok, prompt=[5, 6, 7]).prompt_logprobs is None
    p = _choices(tok, prompt=[5, 6, 7], prompt_logprobs=2)
    assert p.prompt_logprobs == 2 and p.request.params["prompt_logprobs"] == 2
    # with echo + logprobs the engine scores the prompt once, with the larger number of alternatives
    both = _choices(tok, prompt=[5, 6, 7], prompt_logprobs=1, echo=True, logprobs=4)
    assert both.prompt_logprobs == 1 and both.request.params["prompt_logprobs"] == 4
    assert _choices(tok, "chat", messages=[{"role": "user", "content": "hi"}], prompt_logprobs=0).prompt_logprobs == 0
    for body in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": True},
                 {"prompt_logprobs": 1, "stream": True}):
        with pytest.raises(InvalidRequest) as e:
            _choices(tok, prompt="hi", **body)
        assert e.value.param == "prompt_logprobs", body
    text = {5: "a", 6: "b", 7: "c", 9: "z"}.__getitem__
    entries = [None, (-1.0, [(9, -0.5), (6, -1.0), (7, -3.0)], 2), (-0.1, [(7, -0.1), (9, -4.0), (5, -5.0)], 1)]
    assert prompt_logprobs_body(p, 0, entries, text) == [
        None,
        {"6": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}, "9": {"logprob": -0.5, "rank": 1, "decoded_token": "z"}},
        {"7": {"logprob": -0.1, "rank": 1, "decoded_token": "c"}, "9": {"logprob": -4.0, "rank": 2, "decoded_token": "z"}}]
    assert prompt_logprobs_body(_choices(tok, prompt=[5, 6, 7]), 0, entries, text) is None


def test_fields_the_server_does_not_read_are_named():
    """vLLM's treatment of unknown fields: accepted, and named in a warning (the ingress logs
    each name once); the fields parse() reads or refuses are never named."""
    from keyacc_ray.serve.protocol import NEUTRAL, READ_FIELDS, ignored_fields

    body = {"model": "m", "prompt": "x", "max_tokens": 3, "temperature": 0, "user": "u", "tools": None,
            "metadata": {"a": 1}, "store": True, "frobnicate": 1, "keyacc": {"route": "gpu"}}
    assert ignored_fields(body) == ["frobnicate", "metadata", "store"]
    assert not READ_FIELDS & set(NEUTRAL)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("ids", [False, True])
def test_a_text_chunks_event_is_the_whole_bodys_encoding(qwen3_path, kind, ids):
    """The ingress makes a mid-stream chunk of nothing but text (and its token ids, where asked
    for) from those alone: the same bytes as encoding the whole chunk (ASCII-escaped: quotes,
    backslashes, line and paragraph separators, astral characters, control characters), for
    every choice index."""
    from keyacc_ray.serve.ingress import _sse
    from keyacc_ray.serve.protocol import chunk_body, sse_text_event

    tok = AutoTokenizer.from_pretrained(qwen3_path)
    body = {"model": "m", "n": 3, "stream": True, **({"return_token_ids": True} if ids else {}),
            **({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"})}
    p = parse(body, kind, tokenizer=tok, served_names={"m"}, max_model_len=256)
    assert p.return_token_ids == ids
    texts = ["a", " word", 'q"uote\\', "line\nbreak\u2028sep\u0085", "жЖ€𝄞", "\x00\x1c\t", "}]}\", \"x"]
    for k in range(3):
        event = sse_text_event(p, 1700000000, k)
        for n, text in enumerate(texts):
            token_ids = list(range(7, 7 + n))  # (none, one, several)
            assert event(text, token_ids) == _sse(chunk_body(p, 1700000000, text, None, token_ids, index=k))
        assert (event("", [3]) is None) == (kind == "chat")  # (chat's empty delta is `{}`: the whole path)
        if kind != "chat":
            assert event("", [3]) == _sse(chunk_body(p, 1700000000, "", None, [3], index=k))


def test_client_request_id(qwen3_path):
    """vLLM's X-Request-Id: the response's id carries it, each choice's id inside the graph carries
    it and a part of its own (two clients may send one id), a malformed one is a 400."""
    from keyacc_ray.serve.protocol import client_request_id

    tok = AutoTokenizer.from_pretrained(qwen3_path)
    assert client_request_id(None) is None
    assert client_request_id("trace-1.a:b_c") == "trace-1.a:b_c"
    for bad in ("", "a b", "x" * 129, "é", "a\nb"):
        with pytest.raises(InvalidRequest) as e:
            client_request_id(bad)
        assert e.value.param == "X-Request-Id"
    body = {"model": "m", "prompt": "hi", "n": 2}
    one, two = (parse(body, "completion", tokenizer=tok, served_names={"m"}, max_model_len=256, request_id="job-7")
                for _ in range(2))
    assert one.response_id == two.response_id == "cmpl-job-7"
    ids = [r.request_id for r in one.requests + two.requests]
    assert len(set(ids)) == 4 and all(i.startswith("cmpl-job-7-") for i in ids)
    chat = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat", tokenizer=tok,
                 served_names={"m"}, max_model_len=256, request_id="job-7")
    assert chat.response_id == "chatcmpl-job-7" and chat.request.request_id.startswith("chatcmpl-job-7-")
    plain = parse(body, "completion", tokenizer=tok, served_names={"m"}, max_model_len=256)
    assert plain.response_id.startswith("cmpl-") and plain.requests[0].request_id.startswith(plain.response_id)
