"""The default graph through real HTTP with the official openai client: outputs equal
transformers' generate(), pinned routes, streaming, stops, usage and errors."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

import keyacc_ray
from tests.conftest import tiny_model
from tests.e2e.conftest import replica_counter
from tests.helpers import PROMPTS, hf_greedy, hf_model

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def client(app_url):
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", timeout=60, max_retries=0)


def ref_ids(prompt: str, n: int) -> list[int]:
    path = tiny_model("qwen3")
    _, tok = hf_model(path)
    return hf_greedy(path, tok(prompt)["input_ids"], n)


def chat_ref(messages, n):
    path = tiny_model("qwen3")
    _, tok = hf_model(path)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf_greedy(path, tok(text, add_special_tokens=False)["input_ids"], n, stop_at_eos=True)


def test_the_kv_directory_is_up_before_the_first_hand_off(app_url):
    """The pools make the KV directory actor when they start: made by the first hand-off instead,
    that hand-off waited for a process to start (a 1.3 s gap in its stream on this box)."""
    import ray

    from keyacc_ray.serve.kv_directory import NAME
    from keyacc_ray.serve.pools import MONITOR_NAMESPACE

    directory = ray.get_actor(NAME, namespace=MONITOR_NAMESPACE)
    assert ray.get(directory.size.remote(), timeout=30) == 0


def test_models_and_health(app_url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    assert httpx.get(f"{app_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{app_url}/version").json() == {"version": keyacc_ray.__version__}  # as vLLM's /version


def test_http_reaches_the_ingress_through_serve_haproxy(app_url):
    """The cluster env turns Serve's HAProxy mode on: HAProxy holds the HTTP port and forwards to
    the ingress replica's own HTTP server; no Python proxy actor carries the tokens."""
    import psutil

    port = int(app_url.rsplit(":", 1)[1])
    listeners = {psutil.Process(c.pid).name() for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
    assert listeners == {"haproxy"}, listeners
    assert httpx.get(f"{app_url}/v1/models").status_code == 200


def test_completion_matches_generate(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.token_ids == ref_ids(PROMPTS[3], 20)
    _, tok = hf_model(tiny_model("qwen3"))
    assert choice.text == tok.decode(choice.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == len(tok(PROMPTS[3])["input_ids"])
    segs = r.model_extra["keyacc"]["segments"]
    # one GPU engine for both phases (colocated, the default): no KV hand-off, no second copy of the weights
    assert [(s["pool"], s["phase"], s["deployment"]) for s in segs] == [("gpu", "whole", "GpuDecode")]
    assert "kv" not in segs[0] and r.model_extra["keyacc"]["moves"] == 0
    assert sum(s["tokens"] for s in segs) == 20


def test_streaming_completion_matches(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    ids, text, usage, reasons, trace = [], "", None, [], None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            ids += c.model_extra.get("token_ids", [])
            text += c.text
            reasons.append(c.finish_reason)
        trace = (ch.model_extra or {}).get("keyacc") or trace
    assert ids == ref_ids(PROMPTS[8], 24)
    assert reasons[-1] == "length" and usage.completion_tokens == 24
    assert trace and sum(s["tokens"] for s in trace["segments"]) == 24


def test_x_request_id_names_the_request(app_url, client):
    """vLLM's X-Request-Id over real HTTP: the response's id carries it and echoes the header, in
    a body and in a stream (each chunk's id); the same id twice is two requests; a malformed one is
    a clear 400, the server stays up."""
    want = ref_ids(PROMPTS[2], 6)
    for _ in range(2):  # the same id again: another request through the graph, not a clash
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, extra_headers={"X-Request-Id": "job-42.a"},
            extra_body={"ignore_eos": True, "return_token_ids": True})
        r = raw.parse()
        assert r.id == "cmpl-job-42.a" and raw.headers["x-request-id"] == "job-42.a"
        assert r.choices[0].token_ids == want
    with httpx.stream("POST", f"{app_url}/v1/chat/completions", headers={"X-Request-Id": "chat:7"}, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "stream": True}) as s:
        assert s.status_code == 200 and s.headers["x-request-id"] == "chat:7"
        ids = {json.loads(line[6:])["id"] for line in s.iter_lines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-chat:7"}
    bad = httpx.post(f"{app_url}/v1/completions", headers={"X-Request-Id": "no spaces allowed"}, timeout=30,
                     json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_chat_streaming_and_not(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]
    want = chat_ref(msgs, 30)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].message.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=30, temperature=0, stream=True) if ch.choices)
    assert text == r.choices[0].message.content
    # vLLM's continuous_usage_stats: every chunk says how many tokens the choice has so far
    _, tok = hf_model(tiny_model("qwen3"))
    prompt_tokens = len(tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"])
    seen = []
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, temperature=0, stream=True,
                                             stream_options={"include_usage": True, "continuous_usage_stats": True},
                                             extra_body={"return_token_ids": True, "ignore_eos": True}):
        assert ch.usage is not None and ch.usage.prompt_tokens == prompt_tokens
        got = sum(len(c.model_extra.get("token_ids") or []) for c in ch.choices)
        seen.append((ch.usage.completion_tokens, got))
    assert seen[0][0] == 0 and seen[-1][0] == 30
    counts = [u for u, _ in seen]
    assert counts == sorted(counts)
    total = 0
    for u, got in seen[:-1]:  # the last chunk is the usage-only one
        total += got
        assert u == total


def test_batched_prompts_and_n(client):
    """A completions batch with n: one choice per prompt x n (prompt-major), each equal to
    generate(); streamed, the choices' chunks interleave and each choice's tokens come in order."""
    _, tok = hf_model(tiny_model("qwen3"))
    prompts = [PROMPTS[1], PROMPTS[4]]
    kw = dict(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, prompt in zip(r.choices, [prompts[0]] * 2 + [prompts[1]] * 2):
        assert c.token_ids == ref_ids(prompt, 8) and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert r.usage.completion_tokens == 32
    assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)
    segs = r.model_extra["keyacc"]["segments"]
    assert sorted({s["choice"] for s in segs}) == [0, 1, 2, 3] and sum(s["tokens"] for s in segs) == 32
    ids, reasons, usage = {}, {}, None
    for ch in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = ch.usage or usage
        for c in ch.choices:
            ids.setdefault(c.index, []).extend(c.model_extra.get("token_ids", []))
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert ids == {c.index: c.token_ids for c in r.choices}
    assert reasons == {i: "length" for i in range(4)} and usage.completion_tokens == 32


def test_n_seeded_samples_differ_and_each_reproduces(client):
    """n sampled choices with a seed: choice j is the single request with seed + j (vLLM's rule)."""
    kw = dict(model=MODEL, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(prompt=PROMPTS[0], n=3, seed=5, **kw)
    got = [c.token_ids for c in r.choices]
    assert len({tuple(g) for g in got}) == 3
    for j in range(3):
        assert client.completions.create(prompt=PROMPTS[0], seed=5 + j, **kw).choices[0].token_ids == got[j]
    msgs = [{"role": "user", "content": "Hello, world!"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=10, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same twice
    text, roles = {0: "", 1: ""}, []
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=10, temperature=0,
                                             stream=True):
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            roles += [c.index] if c.delta.role else []
    assert sorted(roles) == [0, 1] and text == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}


@pytest.mark.parametrize("route", ["gpu", "stage", "cpu"])
def test_penalties_match_generate_on_every_route(client, route):
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty: the tokens of
    transformers' generate() with the same processing, wherever the request ran (stage: the
    decode continues on the CPU pool with the prompt and output counted as before the move)."""
    from tests.engine.test_penalties import hf_penalized

    _, tok = hf_model(tiny_model("qwen3"))
    r = client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=16, temperature=0,
                                  presence_penalty=0.4, frequency_penalty=0.8,
                                  extra_body={"repetition_penalty": 1.3, "ignore_eos": True, "return_token_ids": True,
                                              "keyacc": {"route": route}})
    ids = tok(PROMPTS[8])["input_ids"]
    assert r.choices[0].token_ids == hf_penalized(tiny_model("qwen3"), ids, 16, presence=0.4, frequency=0.8,
                                                  repetition=1.3)


def test_logit_bias_forces_a_token_wherever_the_request_runs(client):
    for route in ("gpu", "stage", "cpu"):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0.7, seed=1,
                                      logit_bias={"77": 100},
                                      extra_body={"ignore_eos": True, "return_token_ids": True, "keyacc": {"route": route}})
        assert r.choices[0].token_ids == [77] * 6, route
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"91": 100}, extra_body={"ignore_eos": True,
                                                                                             "return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == [91] * 4


@pytest.mark.parametrize("route", ["gpu", "stage", "cpu"])
def test_min_tokens_holds_off_the_end_on_every_route(client, route):
    _, tok = hf_model(tiny_model("qwen3"))
    eos = str(tok.eos_token_id)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=12, temperature=0, logit_bias={eos: 30},
                                  extra_body={"min_tokens": 4, "return_token_ids": True, "keyacc": {"route": route}})
    ids = r.choices[0].token_ids
    assert len(ids) == 5 and ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:4]
    assert r.choices[0].finish_reason == "stop"


def test_chat_without_max_tokens_gets_the_rest_of_the_served_context(app_url, client):
    """Most OpenAI clients send no max_tokens: the request gets the rest of the context the app
    serves, which every pool's KV budget holds (a budget smaller than the model's context caps
    it), and runs like any other."""
    from tests.e2e.conftest import SERVED_CONTEXT

    assert httpx.get(f"{app_url}/v1/models").json()["data"][0]["max_model_len"] == SERVED_CONTEXT
    msgs = [{"role": "user", "content": "Tell me everything."}]
    for route in ("gpu", "cpu"):
        r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           extra_body={"return_token_ids": True, "keyacc": {"route": route}})
        u = r.usage
        assert r.choices[0].model_extra["token_ids"] == chat_ref(msgs, SERVED_CONTEXT - u.prompt_tokens), route
        assert r.choices[0].finish_reason == "stop" or u.prompt_tokens + u.completion_tokens == SERVED_CONTEXT


@pytest.mark.parametrize("route", ["gpu", "stage", "cpu"])
def test_logprobs_match_transformers_on_every_route(client, route):
    """Completions `logprobs: N` and chat `logprobs` / `top_logprobs`: transformers' own
    log-probabilities, wherever the tokens were made (stage: prefill on the GPU pool, decode on
    the CPU pool, the first token's logprobs from the GPU)."""
    from tests.engine.test_logprobs import hf_logprobs

    path = tiny_model("qwen3")
    _, tok = hf_model(path)
    prompt = tok(PROMPTS[4])["input_ids"]
    extra = {"ignore_eos": True, "return_token_ids": True, "keyacc": {"route": route}}
    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=12, temperature=0, logprobs=3,
                                  extra_body=extra)
    c = r.choices[0]
    ref = hf_logprobs(path, prompt, c.token_ids)
    assert c.token_ids == ref_ids(PROMPTS[4], 12)
    assert len(c.logprobs.token_logprobs) == 12
    for t, (lp, top) in enumerate(zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs)):
        assert abs(lp - float(ref[t, c.token_ids[t]])) < 1e-4
        want = torch.topk(ref[t], 3)  # keyed by text: two ids with the same text share one entry
        assert {tok.decode([i]) for i in want.indices.tolist()} == set(top)
        assert max(top.values()) == pytest.approx(float(want.values[0]), abs=1e-4)
    assert c.logprobs.tokens == [tok.decode([i]) for i in c.token_ids]
    stream = list(client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=12, temperature=0,
                                            logprobs=3, stream=True, extra_body=extra))
    lps = [x for ch in stream if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    offsets = [x for ch in stream if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.text_offset]
    assert lps == pytest.approx(c.logprobs.token_logprobs, abs=1e-5)
    assert offsets == c.logprobs.text_offset
    msgs = [{"role": "user", "content": "Hello, world!"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body=extra)
    content = r.choices[0].logprobs.content
    ids = r.choices[0].model_extra["token_ids"]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ref = hf_logprobs(path, tok(text, add_special_tokens=False)["input_ids"], ids)
    assert len(content) == len(ids) == r.usage.completion_tokens
    for t, e in enumerate(content):
        assert abs(e.logprob - float(ref[t, ids[t]])) < 1e-4 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == pytest.approx(float(ref[t].max()), abs=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def hf_prompt_scores(path: str, ids: list[int]) -> torch.Tensor:
    model, _ = hf_model(path)
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("route", ["gpu", "stage", "cpu"])
def test_echo_scores_the_prompt_as_lm_eval_asks(client, route):
    """lm-evaluation-harness's loglikelihood request (`local-completions`): a batch of token-id
    prompts, echo, logprobs 1, max_tokens 1, temperature 0. Each choice's text starts with its
    prompt; its logprobs cover prompt + generated token, the prompt's first entry null and every
    other one transformers' score of that token given the ones before it, whichever pool prefilled."""
    path = tiny_model("qwen3")
    _, tok = hf_model(path)
    prompts = [tok(PROMPTS[0])["input_ids"], tok(PROMPTS[3])["input_ids"]]
    extra = {"return_token_ids": True, "keyacc": {"route": route}}
    r = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                  temperature=0, seed=1234, extra_body=extra)
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 2
    plain = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, extra_body=extra)
    for c, ids, p in zip(sorted(r.choices, key=lambda c: c.index), prompts, plain.choices):
        lp = c.logprobs
        assert c.text == tok.decode(ids) + p.text and c.token_ids == p.token_ids
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = hf_prompt_scores(path, ids + c.token_ids)
        for t in range(1, len(ids) + 1):
            assert lp.token_logprobs[t] == pytest.approx(float(ref[t - 1, (ids + c.token_ids)[t]]), abs=1e-4)
            assert max(lp.top_logprobs[t].values()) == pytest.approx(float(ref[t - 1].max()), abs=1e-4)
        assert c.token_ids == hf_greedy(path, ids, 1, stop_at_eos=False)
        # streamed: the same text and scores, the prompt's in the first chunk
        chunks = [ch.choices[0] for ch in client.completions.create(
            model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0, stream=True,
            extra_body=extra) if ch.choices]
        assert "".join(ch.text for ch in chunks) == c.text
        assert chunks[0].text.startswith(tok.decode(ids))
        streamed = [x for ch in chunks if ch.logprobs for x in ch.logprobs.token_logprobs]
        assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
        assert [x for ch in chunks if ch.logprobs for x in ch.logprobs.text_offset] == lp.text_offset
    # max_tokens 0 with echo: the prompt, scored, and nothing generated (as vLLM)
    only = client.completions.create(model=MODEL, prompt=prompts[1], echo=True, logprobs=0, max_tokens=0,
                                     temperature=0, extra_body=extra).choices[0]
    assert only.text == tok.decode(prompts[1]) and only.finish_reason == "length"
    assert len(only.logprobs.token_logprobs) == len(prompts[1]) and only.model_extra["token_ids"] == []
    # a string prompt comes back as sent, followed by the same text a plain request gets
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, extra_body=extra)
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, echo=True,
                                       extra_body=extra)
    assert echoed.choices[0].text == PROMPTS[2] + plain.choices[0].text and echoed.choices[0].logprobs is None


def test_tokenizer_endpoints_as_vllm_serves_them(app_url):
    """/tokenize, /detokenize and /tokenizer_info (what lm-evaluation-harness's remote tokenizer
    looks for): the served tokenizer's own ids, a round trip, and OpenAI-shaped errors."""
    _, tok = hf_model(tiny_model("qwen3"))
    r = httpx.post(f"{app_url}/tokenize", json={"prompt": PROMPTS[1], "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == tok(PROMPTS[1], add_special_tokens=False)["input_ids"]
    back = httpx.post(f"{app_url}/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]}, timeout=30)
    assert back.json() == {"prompt": PROMPTS[1]}
    info = httpx.get(f"{app_url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    bad = httpx.post(f"{app_url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("route, expect", [
    ("gpu", [("gpu", "whole")]),
    ("cpu", [("cpu", "whole")]),
    ("stage", [("gpu", "prefill"), ("cpu", "decode")]),
])
def test_pinned_routes(client, route, expect):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True,
                                              "keyacc": {"route": route}})
    assert r.choices[0].token_ids == ref_ids(PROMPTS[1], 16)
    segs = r.model_extra["keyacc"]["segments"]
    assert [(s["pool"], s["phase"]) for s in segs] == expect
    assert sum(s["tokens"] for s in segs) == 16


@pytest.mark.parametrize("route", ["gpu", "cpu", "stage"])
def test_a_repeated_prompt_is_served_from_the_prefix_cache_with_the_same_tokens(app_url, client, route):
    """The second time a prompt comes, the engine that prefills it finds its full blocks cached:
    `usage.prompt_tokens_details.cached_tokens` says how many tokens, streamed or not, and the
    tokens are the first time's (generate()'s) on every route."""
    _, tok = hf_model(tiny_model("qwen3"))
    prompt = f"[{route} {time.monotonic_ns()}] " + " ".join(PROMPTS[:9])
    n = len(tok(prompt)["input_ids"])
    extra = {"ignore_eos": True, "return_token_ids": True, "keyacc": {"route": route}}
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
    assert first.choices[0].token_ids == ref_ids(prompt, 12)
    assert first.usage.prompt_tokens == n and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
    assert again.choices[0].token_ids == first.choices[0].token_ids
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0  # full 16-token blocks
    ids, usage = [], None
    for ch in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body=extra):
        ids += [t for c in ch.choices for t in c.model_extra.get("token_ids", [])]
        usage = ch.usage or usage
    assert ids == first.choices[0].token_ids and usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    pool = "GpuDecode" if route != "cpu" else "CpuDecode"
    deadline = time.monotonic() + 20  # the replicas' load reports reach /metrics within a second or two
    while time.monotonic() < deadline:
        hits = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{app_url}/metrics").text.splitlines()
                if line.startswith("keyacc_prefix_cache_hits_total{") and f'deployment="{pool}"' in line]
        if hits and hits[0] >= 2 * ((n - 1) // 16 * 16):
            break
        time.sleep(0.3)
    assert hits and hits[0] >= 2 * ((n - 1) // 16 * 16), hits


def test_a_handoff_leaves_out_the_head_the_cpu_pool_caches(app_url, client):
    """Two conversations with one head, each prefilled on the GPU engine and decoded on the CPU
    pool (`stage`): the second's hand-off leaves the head's K/V out (the router saw the first's
    head go to the CPU pool), the CPU pool decodes over the head it cached, nothing is computed
    again, and both give generate()'s tokens."""
    head = f"[handoff {time.monotonic_ns()}] " + " ".join(PROMPTS[:9])
    names = ("keyacc_kv_handoff_skipped_tokens_total", "GpuDecode"), \
        ("keyacc_kv_handoff_cached_tokens_total", "CpuDecode"), \
        ("keyacc_kv_handoff_recomputed_tokens_total", "CpuDecode")
    # the counters as of now: the hand-offs of the tests before (the repeated-prompt test's `stage`
    # requests skip heads too) reach /metrics with the replicas' next reports, so wait until they
    # stop moving (a full make test once read GpuDecode's after and CpuDecode's before: 336 vs 176)
    before, deadline = None, time.monotonic() + 15
    while time.monotonic() < deadline:
        now = [replica_counter(app_url, *n) for n in names]
        if now == before:
            break
        before = now
        time.sleep(2.5)  # (an engine gone idle is looked at every HEARTBEAT_S, 2 s)
    left_out = []
    for q in ("first", "second"):
        prompt, rid = f"{head} And the {q} question?", f"handoff-head-{q}-{time.monotonic_ns()}"
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_headers={"X-Request-Id": rid},
                                      extra_body={"ignore_eos": True, "return_token_ids": True,
                                                  "keyacc": {"route": "stage"}})
        assert r.choices[0].token_ids == ref_ids(prompt, 12)
        segments = r.model_extra["keyacc"]["segments"]
        assert [s["pool"] for s in segments] == ["gpu", "cpu"]
        left_out.append(segments[1].get("kv_skipped_tokens", 0))  # the trace says what the hand-off left out
        # the router learns where the request ran from its end, which the ingress sends after the
        # client's last byte (driver.py: `_finish`, bookkeeping off the client's path): wait until
        # the router no longer counts it, or the next request can be routed before it knows
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                rid in row["request_id"] for row in httpx.get(f"{app_url}/keyacc/requests", params={"limit": 1000},
                                                              timeout=10).json()["data"]):
            time.sleep(0.1)
    assert left_out[0] == 0 and left_out[1] >= 64, left_out
    deadline = time.monotonic() + 20  # the replicas' load reports reach /metrics within a second or two
    while time.monotonic() < deadline:
        skipped, cached, recomputed = (a - b for a, b in zip([replica_counter(app_url, *n) for n in names], before))
        if skipped > 0 and cached >= skipped:
            break
        time.sleep(0.3)
    assert skipped >= 64 and cached >= skipped and recomputed == 0, (skipped, cached, recomputed)


@pytest.mark.parametrize("route", ["stage", "cpu"])
def test_migrate_back_streams_without_gap_or_repeat(client, route):
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[6], max_tokens=30, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "keyacc": {"route": route, "migrate_back_after": 7}})
    ids, trace = [], None
    for ch in stream:
        for c in ch.choices:
            ids += c.model_extra.get("token_ids", [])
        trace = (ch.model_extra or {}).get("keyacc") or trace
    assert ids == ref_ids(PROMPTS[6], 30)
    pools = [(s["pool"], s["tokens"]) for s in trace["segments"]]
    if route == "stage":
        assert pools == [("gpu", 1), ("cpu", 7), ("gpu", 22)]
    else:
        assert pools == [("cpu", 7), ("gpu", 23)]
    assert trace["moves"] == len(pools) - 1


def test_random_requests_get_the_same_answer_on_every_route(app_url):
    """keyacc_ray/bench/route_fuzz.py: random combinations of sampling settings, penalties, logit
    bias, min_tokens, stops, logprobs, echo and n, each sent at once down gpu, cpu, stage, and stage
    and cpu with a move back, and streamed once; three cases at a time, so the pools batch, preempt
    and hand off under each other's load. Every answer equals the first (float32 model)."""
    from keyacc_ray.bench import route_fuzz

    vocab = json.loads((Path(tiny_model("qwen3")) / "config.json").read_text())["vocab_size"]
    rep = route_fuzz.run(app_url, MODEL, vocab, cases=15, seed=11, concurrent_cases=3, timeout_s=120)
    assert rep.requests == 15 * 6
    assert rep.errors <= 3, rep.errors  # the cases are valid requests: a 4xx everywhere is the rare exception
    assert not rep.mismatches, [m.to_dict() for m in rep.mismatches[:3]]


def test_random_chat_requests_get_the_same_answer_on_every_route(app_url):
    """The same for chat (keyacc_ray/bench/chat_fuzz.py): conversations with system, developer,
    assistant and tool turns, tools with every tool_choice, json_object / json_schema response
    formats, structured_outputs choice and regex, top logprobs, n (seed 31's cases have each of
    these); the tool calls' names and arguments, the content, finish reasons and logprobs equal
    on every route."""
    from keyacc_ray.bench import route_fuzz

    vocab = json.loads((Path(tiny_model("qwen3")) / "config.json").read_text())["vocab_size"]
    rep = route_fuzz.run(app_url, MODEL, vocab, cases=12, seed=31, concurrent_cases=3, timeout_s=120, api="chat")
    assert rep.requests == 12 * 6
    assert rep.errors <= 2, rep.refusals
    assert not rep.mismatches, [m.to_dict() for m in rep.mismatches[:3]]


def test_sixteen_concurrent_requests(client):
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + i % 9, ["gpu", "cpu", "stage", None][i % 4]) for i in range(16)]

    def one(job):
        prompt, n, route = job
        extra = {"ignore_eos": True, "return_token_ids": True}
        if route:
            extra["keyacc"] = {"route": route}
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                         extra_body=extra).choices[0].token_ids

    with cf.ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(one, jobs))
    for (prompt, n, _), got in zip(jobs, outs):
        assert got == ref_ids(prompt, n)


def preemptions(app_url: str) -> float:
    text = httpx.get(f"{app_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("keyacc_preemptions_total") and 'deployment="GpuDecode"' in line)


def test_gpu_pool_runs_more_than_its_budget_reserves(app_url, client):
    """Lazy KV blocks: four requests of 310 tokens each on the GPU pool, whose 48-block budget
    reserves room for two whole ones, all decode at once (each streams tokens before any of
    them ends); when blocks run out the newest is preempted and recomputed, and every request
    still gets generate()'s tokens."""
    import threading

    prompts = [PROMPTS[i] for i in (0, 4, 9, 13)]
    n = 300
    first_done, counts, lock = threading.Event(), {}, threading.Lock()
    before_any_end = {}

    def one(i):
        ids = []
        for ch in client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=n, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                     "keyacc": {"route": "gpu"}}):
            if ch.choices:
                ids += ch.choices[0].model_extra.get("token_ids") or []
                with lock:
                    counts[i] = len(ids)
        with lock:
            if not first_done.is_set():
                before_any_end.update(counts)
                first_done.set()
        return ids

    with cf.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(one, range(4)))
    assert len(before_any_end) == 4 and min(before_any_end.values()) >= 5, before_any_end
    for p, got in zip(prompts, outs):
        assert got == ref_ids(p, n)
    deadline = time.monotonic() + 10  # the pools report to the monitor within a second or so
    while preemptions(app_url) == 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert preemptions(app_url) > 0  # 4 x 310 tokens in a 768-token budget: some were recomputed


def test_stop_strings_and_seed(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    clean = [i for i in range(8, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3] not in text[:i]]
    assert clean, text
    stop = text[clean[0]:clean[0] + 3]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
    for route in ("gpu", "stage", "cpu"):  # vLLM's include_stop_str_in_output, across a hand-off too
        kept = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop], stream=True,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": True, "keyacc": {"route": route}})
            if c.choices)
        assert kept == text[:text.index(stop) + len(stop)], route
    a = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=3,
                                  extra_body={"return_token_ids": True, "keyacc": {"route": "gpu"}})
    b = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=3,
                                  extra_body={"return_token_ids": True, "keyacc": {"route": "stage"}})
    assert a.choices[0].token_ids == b.choices[0].token_ids  # the RNG state travels with the KV


BAD = [
    (b"{not json", 400, None),
    (json.dumps({"prompt": "hi"}).encode(), 400, "model"),
    (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    (json.dumps({"model": "gpt-5", "prompt": "hi"}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 100000}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "word " * 2000}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "prompt": "hi", "top_p": 7}).encode(), 400, "top_p"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 0}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 500}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "prompt": "hi", "best_of": 2}).encode(), 400, "best_of"),
    (json.dumps({"model": MODEL, "prompt": ["hi", ""]}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "presence_penalty": 3}).encode(), 400, "presence_penalty"),
    (json.dumps({"model": MODEL, "prompt": "hi", "frequency_penalty": "1"}).encode(), 400, "frequency_penalty"),
    (json.dumps({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}).encode(), 400, "repetition_penalty"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "min_tokens": 4}).encode(), 400, "min_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 500}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "keyacc": {"route": "moon"}}).encode(), 400, "keyacc.route"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),  # 0: echo only
    (json.dumps({"model": MODEL, "prompt": "hi", "echo": "yes"}).encode(), 400, "echo"),
    (json.dumps({"model": MODEL, "prompt": "hi", "min_p": 1.5}).encode(), 400, "min_p"),
    (json.dumps({"model": MODEL, "prompt": "hi", "use_beam_search": True}).encode(), 400, "use_beam_search"),
    (json.dumps({"model": MODEL, "prompt": "hi", "guided_choice": []}).encode(), 400, "guided_choice"),
    (json.dumps({"model": MODEL, "prompt": "hi", "guided_regex": "(a"}).encode(), 400, "guided_regex"),
    (json.dumps({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}).encode(), 400, "response_format.json_schema.schema"),
    (json.dumps({"model": MODEL, "prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]}).encode(), 400,
     "guided_choice"),
    (json.dumps({"model": MODEL, "prompt": "hi", "skip_special_tokens": "no"}).encode(), 400, "skip_special_tokens"),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_requests_get_openai_errors(app_url, body, status, param):
    r = httpx.post(f"{app_url}/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param


def test_chat_errors_and_good_requests_alongside(app_url, client):
    bad = [{"model": MODEL}, {"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "user"}]},
           {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}]
    with cf.ThreadPoolExecutor(8) as ex:
        good = [ex.submit(client.completions.create, model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                          extra_body={"ignore_eos": True, "return_token_ids": True}) for _ in range(3)]
        errs = [ex.submit(httpx.post, f"{app_url}/v1/chat/completions", json=b, timeout=30) for b in bad]
        for f in errs:
            assert f.result().status_code == 400 and "error" in f.result().json()
        for f in good:
            assert f.result().choices[0].token_ids == ref_ids(PROMPTS[2], 10)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_metrics_show_pools_and_emulation(app_url):
    text = httpx.get(f"{app_url}/metrics", timeout=10).text
    assert 'keyacc_free_kv_blocks{deployment="GpuDecode",emulated="1",pool="gpu"' in text  # (labels sorted)
    assert 'emulated="1"' in text  # no CUDA here: the GPU role is emulated, and says so
    assert "keyacc_requests_started_total" in text
    assert "keyacc_gpu_available 0.0" in text or "keyacc_gpu_available 1.0" in text


def test_vllm_metrics_and_the_dashboard(app_url, client):
    """vLLM's series with pool labels, the request histograms fed by requests on each pool (a
    pinned CPU request's tokens on the CPU pool), the engines' queue time; every query of the
    Grafana dashboard names a series this server exports."""
    from keyacc_ray.bench.timeline import parse_prometheus
    from tests.serve.test_metrics import dashboard_metrics

    def scrape():
        text = httpx.get(f"{app_url}/metrics", timeout=10).text
        got: dict = {}
        for name, labels, v in parse_prometheus(text):
            key = (name, labels.get("pool") or (f"{labels['from']}->{labels['to']}" if "from" in labels else None))
            got[key] = got.get(key, 0) + v
        declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        return got, declared

    before, _ = scrape()
    for route in ("gpu", "cpu"):
        client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "keyacc": {"route": route}})
    list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True, "keyacc": {"route": "cpu"}}))
    staged = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "keyacc": {"route": "stage"}})
    first, moved = staged.model_extra["keyacc"]["segments"]
    assert moved["pool"] == "cpu" and moved["kv_bytes"] > 0 and moved["handoff_ms"] >= 0
    # when each hop's replica took it and when its first token reached the ingress, from the
    # request's start there: in that order, hop after hop
    assert 0 <= first["start_ms"] <= first["first_token_ms"] <= moved["start_ms"] <= moved["first_token_ms"]
    # and when the ingress sent each hop: before its replica took it, the next after the last's token
    assert 0 <= first["sent_ms"] <= first["start_ms"]
    assert first["first_token_ms"] <= moved["sent_ms"] <= moved["start_ms"]
    # and when the hop before it ended at the ingress (its hand-off), before the router's answer sent it
    assert "prev_end_ms" not in first and first["first_token_ms"] <= moved["prev_end_ms"] <= moved["sent_ms"]
    # where each hop's tokens waited: in its engine, for its replica's event loop, at the ingress
    for seg in (first, moved):
        assert seg["made_gap_ms"] >= 0 and seg["loop_lag_ms"] >= 0 and 0 <= seg["made_gap_after"] <= seg["tokens"]
    assert moved["made_gap_after"] >= 1
    if "ingress_gap_ms" in moved:  # (its tokens reached the ingress in more than one chunk)
        assert moved["first_token_ms"] <= moved["ingress_gap_at_ms"] and moved["ingress_gap_ms"] >= 0
    wants = [("vllm:generation_tokens_total", "cpu", 9), ("vllm:generation_tokens_total", "gpu", 5),
             ("keyacc_handoffs_total", "gpu->cpu", 1), ("keyacc_handoff_seconds_count", "gpu->cpu", 1),
             ("vllm:time_to_first_token_seconds_count", "cpu", 2), ("vllm:request_prefill_time_seconds_count", "cpu", 2),
             # (each pool's series come with its own load report: wait for every one asserted below)
             ("keyacc_handoff_bytes_total", "gpu->cpu", moved["kv_bytes"]),
             ("vllm:inter_token_latency_seconds_count", "cpu", 7), ("vllm:e2e_request_latency_seconds_count", "gpu", 1),
             ("vllm:request_queue_time_seconds_count", "cpu", 2), ("vllm:request_decode_time_seconds_count", "gpu", 1),
             ("vllm:iteration_tokens_total_count", "gpu", 5), ("vllm:request_params_max_tokens_count", None, 3),
             ("vllm:prompt_tokens_total", None, 3)]

    def grew_in(after, name, pool, by):
        return after.get((name, pool), 0) - before.get((name, pool), 0) >= by

    deadline = time.monotonic() + 20  # the pools' next load reports (a second or two; longer on a slow machine)
    after, declared = scrape()
    while not all(grew_in(after, *w) for w in wants) and time.monotonic() < deadline:
        time.sleep(0.5)
        after, declared = scrape()

    def grew(name, pool, by):
        return grew_in(after, name, pool, by)

    assert grew("vllm:generation_tokens_total", "cpu", 9) and grew("vllm:generation_tokens_total", "gpu", 5)
    assert grew("keyacc_handoffs_total", "gpu->cpu", 1) and grew("keyacc_handoff_bytes_total", "gpu->cpu", moved["kv_bytes"])
    assert grew("keyacc_handoff_seconds_count", "gpu->cpu", 1)
    assert grew("vllm:time_to_first_token_seconds_count", "cpu", 2)
    assert grew("vllm:inter_token_latency_seconds_count", "cpu", 7)
    assert grew("vllm:e2e_request_latency_seconds_count", "gpu", 1)
    assert grew("vllm:request_queue_time_seconds_count", "cpu", 2)
    assert grew("vllm:request_prefill_time_seconds_count", "cpu", 2)  # the CPU pool prefilled the pinned ones
    assert grew("vllm:request_decode_time_seconds_count", "gpu", 1) and grew("vllm:iteration_tokens_total_count", "gpu", 5)
    assert grew("vllm:request_params_max_tokens_count", None, 3)
    assert grew("vllm:prompt_tokens_total", None, 3)
    assert after[("keyacc_router_up", None)] == 1 and ("vllm:kv_cache_usage_perc", "gpu") in after
    exported = {n for n, _ in after} | declared
    assert not dashboard_metrics() - exported, dashboard_metrics() - exported


@pytest.mark.parametrize("route", ["gpu", "stage", "cpu"])
def test_prompt_logprobs_as_vllm_returns_them(client, route):
    """vLLM's `prompt_logprobs: N`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's own token (its rank under the model) and the N likeliest,
    each equal to transformers' score of that position given the tokens before it, whichever pool
    prefilled; with echo + logprobs the echo keeps its own number of alternatives; in chat once
    per response; refused when streaming, as vLLM does."""
    path = tiny_model("qwen3")
    _, tok = hf_model(path)
    ids = tok(PROMPTS[1])["input_ids"]
    ref = hf_prompt_scores(path, ids)
    extra = {"keyacc": {"route": route}}
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0, echo=True,
                                  logprobs=1, extra_body={**extra, "prompt_logprobs": 3})
    choices = sorted(r.choices, key=lambda c: c.index)
    for c, prompt in zip(choices, [ids, ids[:3]]):
        plp = c.model_extra["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None
        for t in range(1, len(prompt)):
            row, own = ref[t - 1], str(prompt[t])
            top = torch.topk(row, 3).indices.tolist()
            assert list(plp[t])[0] == own  # the prompt's own token first, then the likeliest
            assert {int(k) for k in plp[t]} == {prompt[t], *top}
            assert plp[t][own]["logprob"] == pytest.approx(float(row[prompt[t]]), abs=1e-4)
            lp = row[prompt[t]]  # its rank, up to ties within float noise
            assert int((row > lp + 1e-4).sum()) + 1 <= plp[t][own]["rank"] <= int((row > lp - 1e-4).sum()) + 1
            assert plp[t][own]["decoded_token"] == tok.decode([prompt[t]])
            for rank, j in enumerate(top, 1):
                assert plp[t][str(j)]["rank"] == rank or str(j) == own
                assert plp[t][str(j)]["logprob"] == pytest.approx(float(row[j]), abs=1e-4)
        assert all(d is None or len(d) == 1 for d in c.logprobs.top_logprobs)  # echo: logprobs=1, not 3
    # 0 alternatives: the prompt's own tokens only; no prompt_logprobs unless asked for
    zero = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                     extra_body={**extra, "prompt_logprobs": 0}).choices[0].model_extra
    assert [list(d) if d else None for d in zero["prompt_logprobs"]] == [None] + [[str(t)] for t in ids[1:]]
    assert "prompt_logprobs" not in client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                                              extra_body=extra).choices[0].model_extra
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0,
                                          extra_body={**extra, "prompt_logprobs": 1})
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    chat_ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(chat.model_extra["prompt_logprobs"]) == len(chat_ids) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1, stream=True,
                                  extra_body={**extra, "prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 21})
