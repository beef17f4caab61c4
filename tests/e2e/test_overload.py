"""Overload: with small bounded queues, a burst far past capacity gets fast 503s with
Retry-After in OpenAI's shape, everything else completes with the right tokens, and the server
stays healthy. Redeploys the session's app with small queues, then back."""
from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
from ray import serve

from keyacc_ray.serve.app import build_app
from tests.conftest import tiny_model
from tests.e2e.conftest import APP_ARGS, wait_for_monitor
from tests.helpers import PROMPTS, hf_greedy, hf_model

SMALL = {"max_num_seqs": 2, "max_waiting": 2, "max_ongoing_requests": 4, "max_queued_requests": 2,
         "num_threads": 1, "num_cpus": 0.5}


@pytest.fixture(scope="module")
def small_app(app_url):
    serve.run(build_app({**APP_ARGS, "gpu": {**SMALL, "device": "auto", "num_kv_blocks": 48}, "cpu": SMALL}),
              name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)
    yield app_url
    serve.run(build_app(APP_ARGS), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)


def test_burst_past_capacity_gets_fast_503s_and_the_rest_completes(small_app):
    _, tok = hf_model(tiny_model("qwen3"))

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        t = time.perf_counter()
        r = httpx.post(f"{small_app}/v1/completions", timeout=120, json={
            "model": "tiny-qwen3", "prompt": prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "keyacc": {"route": "gpu"}})
        return prompt, r, time.perf_counter() - t

    with cf.ThreadPoolExecutor(40) as ex:
        results = list(ex.map(one, range(40)))
    ok = [(p, r) for p, r, _ in results if r.status_code == 200]
    rejected = [(r, dt) for _, r, dt in results if r.status_code != 200]
    assert ok and rejected, [r.status_code for _, r, _ in results]
    for r, dt in rejected:
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text)
        assert r.json()["error"]["message"] and dt < 10
    for p, r in ok:
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny_model("qwen3"), tok(p)["input_ids"], 120)
    assert httpx.get(f"{small_app}/health", timeout=10).status_code == 200


def test_two_ingress_replicas_share_one_router(app_url):
    """ingress_replicas: 2 (issue #22's scale-out): requests spread over both replicas; the one
    router's in-flight counts settle to zero; a burst still offloads by policy; whichever replica
    answers /metrics shows every request, and its counters never go backwards."""
    from keyacc_ray.bench.timeline import parse_prometheus
    from tests.e2e.test_offload import router_inflight_settles

    serve.run(build_app({**APP_ARGS, "ingress_replicas": 2, "policy": "full_offload",
                         "policy_options": {"trigger_window_s": 0.05, "return_window_s": 0.3}}),
              name="keyacc", route_prefix="/")
    try:
        wait_for_monitor(app_url)
        status = serve.status().applications["keyacc"].deployments["Ingress"]
        assert sum(status.replica_states.values()) == 2, status.replica_states

        def success() -> float:
            text = httpx.get(f"{app_url}/metrics", timeout=10).text
            return sum(v for n, lab, v in parse_prometheus(text) if n == "vllm:request_success_total")

        before = success()

        def one(i):
            return httpx.post(f"{app_url}/v1/completions", timeout=120, json={
                "model": "tiny-qwen3", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 60, "temperature": 0,
                "ignore_eos": True})
        with cf.ThreadPoolExecutor(16) as ex:
            rs = list(ex.map(one, range(32)))
        assert all(r.status_code == 200 for r in rs)
        assert any(s["pool"] == "cpu" for r in rs for s in r.json()["keyacc"]["segments"]), "nothing offloaded"
        assert router_inflight_settles()
        # each replica's next report to the monitor, and the router's next snapshot: a few seconds,
        # longer on a slow machine; six scrapes in a row (they land on either replica) must agree
        deadline = time.monotonic() + 20
        seen = [success() - before for _ in range(6)]
        while not all(x == 32 for x in seen) and time.monotonic() < deadline:
            time.sleep(0.5)
            seen = [success() - before for _ in range(6)]
        assert all(x == 32 for x in seen), seen
    finally:
        serve.run(build_app(APP_ARGS), name="keyacc", route_prefix="/")
        wait_for_monitor(app_url)


def test_a_burst_the_cpu_pools_queue_cannot_hold_queues_on_the_gpu_instead_of_503s(app_url):
    """`full_offload` overflows a burst to the CPU pool; that pool's engine queue holds 2 here
    (`max_waiting`), the GPU's 64. Every request has a place somewhere, so none gets a 503: the
    router stops sending new requests to a pool whose queue is at its bound (the replicas report
    it), and one the engine refuses anyway goes by the policy to the other pool."""
    cpu = {"max_num_seqs": 2, "max_waiting": 2, "num_threads": 1, "num_cpus": 0.5}
    serve.run(build_app({**APP_ARGS, "policy": "full_offload", "cpu": cpu}), name="keyacc", route_prefix="/")
    try:
        wait_for_monitor(app_url)
        _, tok = hf_model(tiny_model("qwen3"))

        def one(i):
            prompt = PROMPTS[i % len(PROMPTS)]
            return prompt, httpx.post(f"{app_url}/v1/completions", timeout=300, json={
                "model": "tiny-qwen3", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})

        with cf.ThreadPoolExecutor(24) as ex:
            results = list(ex.map(one, range(24)))
        assert [r.status_code for _, r in results] == [200] * 24, [r.text[:200] for _, r in results if r.status_code != 200]
        for p, r in results:
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny_model("qwen3"), tok(p)["input_ids"], 48)
        pools = [{s["pool"] for s in r.json()["keyacc"]["segments"] if s["tokens"]} for _, r in results]
        assert sum("cpu" in p for p in pools) >= 2 and sum("gpu" in p for p in pools) >= 2  # both pools took some
        text = httpx.get(f"{app_url}/metrics", timeout=10).text
        kept = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("keyacc_policy_queue_bound_to_gpu_total", "keyacc_requests_rerouted_total")))
        assert kept >= 1, "the burst never met the CPU queue's bound: the test shows nothing"
    finally:
        serve.run(build_app(APP_ARGS), name="keyacc", route_prefix="/")
        wait_for_monitor(app_url)
