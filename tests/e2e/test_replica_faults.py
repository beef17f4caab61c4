"""A decode replica killed mid-stream: its request goes on elsewhere and the client's stream
continues with no duplicated or missing token (same tokens as without the fault)."""
from __future__ import annotations

import json
import time

import httpx
import pytest
import ray
from ray import serve

from tests.conftest import tiny_model
from tests.helpers import PROMPTS, hf_greedy, hf_model

MODEL = "tiny-qwen3"


def replica_actor(deployment: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in a["name"]:
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(deployment)


def stream_chunks(app_url: str, body: dict):
    """A streamed completion's chunks, parsed; none of them may be an error."""
    with httpx.stream("POST", f"{app_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            yield chunk


def wait_healthy(timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = serve.status().applications["keyacc"]
        if st.status == "RUNNING" and all(d.status == "HEALTHY" for d in st.deployments.values()):
            return
        time.sleep(1)
    raise TimeoutError("the app did not become healthy again")


@pytest.mark.parametrize("route, victim, survivor", [("cpu", "CpuDecode", "gpu"), ("gpu", "GpuDecode", "cpu")])
def test_decode_replica_killed_mid_stream(app_url, route, victim, survivor):
    _, tok = hf_model(tiny_model("qwen3"))
    prompt = PROMPTS[9]
    n = 400
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "keyacc": {"route": route}}
    ids, trace, killed = [], None, False
    for chunk in stream_chunks(app_url, body):
        for c in chunk["choices"]:
            ids += c.get("token_ids", [])
        trace = chunk.get("keyacc") or trace
        if not killed and len(ids) >= 8:
            ray.kill(replica_actor(victim), no_restart=True)
            killed = True
    assert killed
    assert ids == hf_greedy(tiny_model("qwen3"), tok(prompt)["input_ids"], n)
    segs = trace["segments"]
    failed = [s for s in segs if s.get("failed")]
    assert failed and failed[0]["deployment"] == victim, segs
    assert segs[-1]["pool"] == survivor
    assert sum(s["tokens"] for s in segs) == n
    wait_healthy()


def test_load_monitor_killed_router_keeps_routing_and_monitor_returns(app_url):
    from keyacc_ray.serve.pools import MONITOR_NAME, MONITOR_NAMESPACE

    killed_at = time.monotonic()
    ray.kill(ray.get_actor(MONITOR_NAME, namespace=MONITOR_NAMESPACE), no_restart=False)
    for _ in range(5):  # routing goes on with the last snapshot while the monitor restarts
        r = httpx.post(f"{app_url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8

    def fresh() -> bool:
        text = httpx.get(f"{app_url}/metrics", timeout=10).text
        age = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("keyacc_monitor_snapshot_age_seconds")]
        return bool(age) and age[0] < 1.0 and all(f'deployment="{d}"' in text
                                                 for d in ("GpuDecode", "CpuDecode"))

    # A snapshot younger than 1 s, taken more than 8 s after the kill (older reports are dropped
    # after 5 s), can only come from a monitor that is back and hears from every pool again.
    time.sleep(max(0.0, 8 - (time.monotonic() - killed_at)))
    deadline = time.monotonic() + 60
    while not fresh():
        assert time.monotonic() < deadline, "the monitor did not come back"
        time.sleep(0.5)


def _gpu_decode_busy(app_url) -> tuple[float, float, float]:
    text = httpx.get(f"{app_url}/metrics", timeout=10).text
    vals = {}
    for line in text.splitlines():
        if 'deployment="GpuDecode"' in line and not line.startswith("#"):
            vals[line.split("{")[0]] = float(line.split()[-1])
    return vals["keyacc_running_sequences"], vals["keyacc_free_kv_blocks"], vals["keyacc_total_kv_blocks"]


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_frees_sequence_and_blocks(app_url, n):
    """Every choice's sequence (n of them) is aborted and its blocks freed when the client hangs up
    (left alone, they would run for far longer than the deadline below)."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0,
            "stream": True, "ignore_eos": True, "keyacc": {"route": "gpu"}, "n": n}
    with httpx.stream("POST", f"{app_url}/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # hang up mid-stream
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        running, free, total = _gpu_decode_busy(app_url)
        if running == 0 and free == total:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"sequence not freed after disconnect: {_gpu_decode_busy(app_url)}")


def test_gpu_engine_replica_killed_request_still_served(app_url):
    """The GPU engine (colocated: prefill and decode) killed before a request arrives: it is
    served all the same (elsewhere while Serve replaces the replica)."""
    _, tok = hf_model(tiny_model("qwen3"))
    ray.kill(replica_actor("GpuDecode"), no_restart=True)
    r = httpx.post(f"{app_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPTS[2], "max_tokens": 20, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "keyacc": {"route": "gpu"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny_model("qwen3"), tok(PROMPTS[2])["input_ids"], 20)
    wait_healthy()


def test_router_killed_requests_in_flight_and_arriving_are_served(app_url):
    """The router replica dies while streams run on both pools and new requests arrive: the
    streams go on (they need the router only between hops), the new requests are routed by the
    drivers' own fallback until Serve has a new router, every output equals generate(), and the
    new router's in-flight counts settle to zero (requests it never began are not counted)."""
    import concurrent.futures as cf

    from tests.e2e.test_offload import router_inflight_settles

    _, tok = hf_model(tiny_model("qwen3"))
    n = 700  # the served context is 768: long enough to be in flight on any machine when the kill comes

    def streamed(prompt, route, started):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True, "keyacc": {"route": route}}
        ids = []
        for chunk in stream_chunks(app_url, body):
            ids += [t for c in chunk["choices"] for t in c.get("token_ids", [])]
            if ids:
                started.add(prompt)
        return prompt, ids, n

    def plain(prompt):
        r = httpx.post(f"{app_url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return prompt, r.json()["choices"][0]["token_ids"], 24

    started: set = set()
    with cf.ThreadPoolExecutor(12) as ex:
        streams = [ex.submit(streamed, PROMPTS[i], route, started) for i, route in enumerate(["gpu", "cpu", "gpu", "cpu"])]
        deadline = time.monotonic() + 30
        while len(started) < len(streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) == len(streams), "the streams did not start"
        ray.kill(replica_actor("Router"), no_restart=True)
        in_flight = [not f.done() for f in streams]
        arriving = [ex.submit(plain, PROMPTS[4 + i]) for i in range(4)]
        results = [f.result() for f in streams + arriving]
    assert all(in_flight), "a stream ended before the router was killed: the test proves less than it says"
    for prompt, ids, k in results:
        assert ids == hf_greedy(tiny_model("qwen3"), tok(prompt)["input_ids"], k), prompt
    wait_healthy()
    r = httpx.post(f"{app_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert router_inflight_settles()
