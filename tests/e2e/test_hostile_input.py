"""Malformed and hostile requests: each a 4xx in OpenAI's shape; the server stays healthy and
good requests beside them are unaffected. Includes a property-based test over generated bodies."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "tiny-qwen3"
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "n", "logprobs", "tools", "keyacc", "ignore_eos", "return_token_ids", "stop_token_ids",
          "max_completion_tokens", "presence_penalty", "echo", "user"]


def post(url: str, path: str, content: bytes, headers=None) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_openai_error(r: httpx.Response, status: int | None = None):
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if status is not None:
        assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]


HOSTILE = [
    (b"\xff\xfe\xfa not utf-8", None),
    (b"[1, 2, 3]", None),
    (b"null", None),
    (json.dumps({"model": MODEL, "prompt": "x" * 10, "pad": "y" * (2 << 20)}).encode(), None),  # over the body limit
    (json.dumps({"model": MODEL, "prompt": "hi", "stop": [f"s{i}" for i in range(100)]}).encode(), "stop"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stop": "x" * 1000}).encode(), "stop"),
    (json.dumps({"model": MODEL, "prompt": "hi", "seed": 2**80}).encode(), "seed"),
    (json.dumps({"model": MODEL, "prompt": "hi", "seed": "7"}).encode(), "seed"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": 1e9}).encode(), "temperature"),
    (b'{"model": "tiny-qwen3", "prompt": "hi", "top_p": NaN}', "top_p"),
    (b'{"model": "tiny-qwen3", "prompt": "hi", "temperature": Infinity}', "temperature"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10**30}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3.5}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": [1, 2, 10**12]}).encode(), "prompt"),
    (json.dumps({"model": MODEL, "prompt": [-1]}).encode(), "prompt"),
    (json.dumps({"model": MODEL, "prompt": ["a", ["b"]]}).encode(), "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "tools": [{"type": "function"}]}).encode(), "tools"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 21}).encode(), "logprobs"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logprobs": "5"}).encode(), "logprobs"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}).encode(), "stream"),
    (json.dumps({"model": MODEL, "prompt": "hi", "keyacc": {"route": "cpu", "migrate_back_after": 0}}).encode(),
     "keyacc.migrate_back_after"),
    (json.dumps({"model": ["a"], "prompt": "hi"}).encode(), "model"),
]


@pytest.mark.parametrize("body, param", HOSTILE)
def test_hostile_bodies(app_url, body, param):
    r = post(app_url, "/v1/completions", body)
    assert_openai_error(r)
    if param:
        assert r.json()["error"]["param"] == param


def test_chat_hostile(app_url):
    for body in ({"model": MODEL, "messages": "hi"}, {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x " * 3000}]}):
        assert_openai_error(post(app_url, "/v1/chat/completions", json.dumps(body).encode()), 400)
    assert_openai_error(httpx.get(f"{app_url}/v1/nothing", timeout=10), 404)
    assert_openai_error(httpx.get(f"{app_url}/v1/completions", timeout=10), 405)


value = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
                     | st.floats(allow_nan=False) | st.text(max_size=40),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                     max_leaves=6)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), value, max_size=8).map(
    lambda d: {**d, "model": MODEL} if len(d) % 2 else d)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies, chat=st.booleans())
def test_generated_bodies_never_5xx(app_url, body, chat):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
        body["max_tokens"] = 64  # keep valid generations short
    body.pop("max_completion_tokens", None)
    r = post(app_url, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode())
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "error" in r.json()


def test_still_healthy_after_abuse(app_url):
    assert httpx.get(f"{app_url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{app_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
