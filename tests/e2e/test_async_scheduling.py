"""Asynchronous scheduling (`gpu.async_scheduling`, issue #21) through the whole graph: the session's
app redeployed with the GPU pool (emulated on CPU) decoding over the static buffers (`decode_graphs:
on`, the CPU kernels off) and scheduling asynchronously. Concurrent streams on every route get
generate()'s tokens, one ends on a stop token id, one client hangs up mid-stream; the replica
reports the steps it launched ahead, and every KV block comes back. Then the default app again."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest
from ray import serve

from keyacc_ray.serve.app import build_app
from tests.conftest import tiny_model
from tests.e2e.conftest import APP_ARGS, wait_for_monitor
from tests.helpers import PROMPTS, hf_greedy, hf_model

GPU = {"device": "auto", "max_num_seqs": 8, "num_kv_blocks": 48, "decode_graphs": "on", "cpu_kernels": "off",
       "async_scheduling": True}


@pytest.fixture(scope="module")
def async_app(app_url):
    serve.run(build_app({**APP_ARGS, "gpu": GPU}), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)
    yield app_url
    serve.run(build_app(APP_ARGS), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)


def gpu_decode(url: str) -> dict:
    """GpuDecode's series of interest, from /metrics."""
    got = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if 'deployment="GpuDecode"' in line and not line.startswith("#"):
            got[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return got


def stream(url: str, prompt: str, route: dict, max_tokens: int, hang_up_after: int | None = None, **extra):
    """A greedy stream's token ids and finish reason (None where the client hung up)."""
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "keyacc": route, **extra}
    ids, reason = [], None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            ids += choice.get("token_ids") or []
            reason = choice.get("finish_reason") or reason
            if hang_up_after is not None and len(ids) >= hang_up_after:
                return ids, None
    return ids, reason


def test_async_scheduled_streams_on_every_route_equal_generate(async_app):
    url = async_app
    _, tok = hf_model(tiny_model("qwen3"))
    path = tiny_model("qwen3")
    before = gpu_decode(url).get("keyacc_decode_steps_launched_ahead_total", 0.0)
    stop_prompt = PROMPTS[1]
    stop_id = hf_greedy(path, tok(stop_prompt)["input_ids"], 24)[6]
    jobs = [(PROMPTS[0], {"route": "gpu"}, 12, {}), (PROMPTS[2], {"route": "gpu"}, 30, {}),
            (stop_prompt, {"route": "gpu"}, 24, {"stop_token_ids": [stop_id]}),
            (PROMPTS[3 % len(PROMPTS)], {"route": "gpu"}, 20, {}),
            (PROMPTS[0], {"route": "stage", "migrate_back_after": 6}, 18, {}),  # CPU decode, then back here
            (PROMPTS[4 % len(PROMPTS)], {"route": "cpu"}, 10, {})]
    with cf.ThreadPoolExecutor(8) as ex:
        quitter = ex.submit(stream, url, PROMPTS[2], {"route": "gpu"}, 400, hang_up_after=5)
        futs = [ex.submit(stream, url, p, route, m, **kw) for p, route, m, kw in jobs]
        results = [f.result() for f in futs]
        assert len(quitter.result()[0]) >= 5
    for (prompt, route, m, kw), (ids, reason) in zip(jobs, results):
        want = hf_greedy(path, tok(prompt)["input_ids"], m)
        if kw:  # ends on the stop token id, which it includes (as vLLM's token ids do)
            want = want[:want.index(stop_id) + 1]
            assert reason == "stop"
        else:
            assert reason == "length"
        assert ids == want, (route, m)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        g = gpu_decode(url)
        if g["keyacc_free_kv_blocks"] == g["keyacc_total_kv_blocks"] and g["keyacc_running_sequences"] == 0:
            break
        time.sleep(0.2)
    assert g["keyacc_free_kv_blocks"] == g["keyacc_total_kv_blocks"], g  # the hung-up stream's included
    assert g["keyacc_decode_steps_launched_ahead_total"] > before
