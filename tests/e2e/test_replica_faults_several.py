"""One of a pool's several replicas killed mid-stream: its streams go on on a live replica of
the same pool (the GPU pool's other engine), token-identical to generate(), and the pool is not
taken for gone: the policy's new requests still start there. Redeploys the session's app with
two GPU engine replicas, then back."""
from __future__ import annotations

import concurrent.futures as cf
import re
import time

import httpx
import pytest
import ray
from ray import serve

from keyacc_ray.serve.app import build_app
from tests.conftest import tiny_model
from tests.e2e.conftest import APP_ARGS, wait_for_monitor
from tests.e2e.test_replica_faults import stream_chunks, wait_healthy
from tests.helpers import PROMPTS, hf_greedy, hf_model

MODEL = "tiny-qwen3"
N = 900  # tokens a stream makes: it must still run when the kill comes, on any machine (the served context: 1024)


@pytest.fixture(scope="module")
def two_gpu_replicas(app_url):
    serve.run(build_app({**APP_ARGS, "policy": "full_offload",
                         "gpu": {"replicas": 2, "num_cpus": 0.25, "device": "auto", "num_kv_blocks": 128}}),
              name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)
    yield app_url
    serve.run(build_app(APP_ARGS), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)


def _metric(app_url: str, name: str, **labels) -> list[tuple[dict, float]]:
    out = []
    for line in httpx.get(f"{app_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                out.append((got, float(line.rsplit(" ", 1)[1])))
    return out


def _gpu_replica_running_a_stream(app_url: str, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = [lab["replica"] for lab, v in _metric(app_url, "keyacc_running_sequences", deployment="GpuDecode")
                if v >= 1]
        if busy:
            return busy[0]
        time.sleep(0.1)
    raise AssertionError("no GPU replica reported a running stream")


def test_one_of_two_gpu_replicas_killed_its_streams_go_on_on_the_other(two_gpu_replicas):
    url = two_gpu_replicas
    _, tok = hf_model(tiny_model("qwen3"))
    rerouted_before = sum(v for _, v in _metric(url, "keyacc_requests_rerouted_total", reason="gpu_unavailable"))
    prompts = [PROMPTS[3], PROMPTS[7]]
    started = [0, 0]

    def one(i: int):
        ids, trace = [], None
        for chunk in stream_chunks(url, {"model": MODEL, "prompt": prompts[i], "max_tokens": N, "temperature": 0,
                                         "stream": True, "ignore_eos": True, "return_token_ids": True,
                                         "keyacc": {"route": "gpu"}}):
            for c in chunk["choices"]:
                ids += c.get("token_ids", [])
            started[i] = len(ids)
            trace = chunk.get("keyacc") or trace
        return ids, trace

    with cf.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(one, i) for i in range(2)]
        deadline = time.monotonic() + 60
        while min(started) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        victim = _gpu_replica_running_a_stream(url)
        assert max(started) < N, "a stream ended before the kill: the test proves less than it says"
        actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].endswith(f"#GpuDecode#{victim}"))
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        results = [f.result(timeout=300) for f in futs]

    failed_over = 0
    for p, (ids, trace) in zip(prompts, results):
        assert ids == hf_greedy(tiny_model("qwen3"), tok(p)["input_ids"], N)
        segs = trace["segments"]
        assert all(s["pool"] == "gpu" for s in segs), segs  # on the GPU pool throughout
        for a, b in zip(segs, segs[1:]):
            if a.get("failed"):
                failed_over += 1
                assert a["replica"] == victim and b["deployment"] == "GpuDecode" and b["replica"] != victim, segs
    assert failed_over >= 1
    # a new request the policy sends to the GPU starts there (the pool was not taken for gone)
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == hf_greedy(tiny_model("qwen3"), tok(PROMPTS[2])["input_ids"], 12)
    assert [s["pool"] for s in body["keyacc"]["segments"]] == ["gpu"], body["keyacc"]
    assert sum(v for _, v in _metric(url, "keyacc_requests_rerouted_total", reason="gpu_unavailable")) == \
        rerouted_before
    wait_healthy()
