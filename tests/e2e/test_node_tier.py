"""The node's shared KV tier through the Serve graph: the session's app redeployed with both
pools' engines reading and writing one node tier (a directory of this run's own), then back. A
head one pool computed is loaded by the other, in another process; hand-offs leave it out."""
from __future__ import annotations

import shutil
import tempfile
import time

import openai
import pytest
from ray import serve

from keyacc_ray.serve.app import build_app
from tests.conftest import tiny_model
from tests.e2e.conftest import APP_ARGS, replica_counter, wait_for_monitor
from tests.e2e.test_openai_api import MODEL, ref_ids
from tests.helpers import PROMPTS, hf_model


@pytest.fixture(scope="module")
def client(app_url):
    d = tempfile.mkdtemp(prefix="keyacc-node-tier-")
    # ("always": on a fast CPU the tiny model computes a block about as fast as the node tier reads
    # one, so the cost model's choice went either way and these tests with it)
    tier = {"kv_node_tier_gb": 0.05, "kv_node_tier_dir": d, "kv_tier_load": "always"}
    # (a pool's keys override its defaults one by one: the GPU pool keeps its emulated budget)
    serve.run(build_app({**APP_ARGS, "gpu": dict(tier), "cpu": dict(tier)}), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)
    yield openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", timeout=60, max_retries=0)
    serve.run(build_app(APP_ARGS), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)
    shutil.rmtree(d, ignore_errors=True)


def test_a_head_the_gpu_pool_computed_is_loaded_by_the_cpu_pool_from_the_node_tier(app_url, client):
    """Both pools share the node's KV tier (conftest): a conversation's first turn runs on the GPU
    pool; its next turn, sent whole to the CPU pool (another process), loads the head's blocks the
    GPU engine wrote there instead of computing them: OpenAI's cached_tokens and the CPU
    replica's node-tier counter say so, and both turns give generate()'s tokens."""
    _, tok = hf_model(tiny_model("qwen3"))
    head = f"[node tier {time.monotonic_ns()}] " + " ".join(PROMPTS[:9])
    follow = head + " And then, what?"
    a, b = tok(head)["input_ids"], tok(follow)["input_ids"]
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    extra = {"ignore_eos": True, "return_token_ids": True}
    first = client.completions.create(model=MODEL, prompt=head, max_tokens=12, temperature=0,
                                      extra_body={**extra, "keyacc": {"route": "gpu"}})
    assert first.choices[0].token_ids == ref_ids(head, 12)
    before = replica_counter(app_url, "keyacc_kv_tier_hits_total", "CpuDecode")
    r = client.completions.create(model=MODEL, prompt=follow, max_tokens=12, temperature=0,
                                  extra_body={**extra, "keyacc": {"route": "cpu"}})
    assert r.choices[0].token_ids == ref_ids(follow, 12)
    assert [s["pool"] for s in r.model_extra["keyacc"]["segments"]] == ["cpu"]
    want = min(common, len(b) - 1) // 16 * 16
    assert want >= 64 and r.usage.prompt_tokens_details.cached_tokens == want
    deadline = time.monotonic() + 20  # the replicas' load reports reach /metrics within a second or two
    while time.monotonic() < deadline and replica_counter(app_url, "keyacc_kv_tier_hits_total", "CpuDecode") < before + want:
        time.sleep(0.3)
    assert replica_counter(app_url, "keyacc_kv_tier_hits_total", "CpuDecode") >= before + want


def test_a_handoff_leaves_out_what_the_node_tier_holds_for_the_next_pool(app_url, client):
    """A conversation's first turn runs whole on the GPU pool (its engine writes the blocks into
    the node's tier); the next, prefilled there and decoded on the CPU pool (`stage`), hands off
    without the head: the router knows from the replicas' reports that both pools read that
    tier, the CPU engine loads the head from it, nothing is computed again, and both turns give
    generate()'s tokens."""
    head = f"[node handoff {time.monotonic_ns()}] " + " ".join(PROMPTS[:9])
    extra = {"ignore_eos": True, "return_token_ids": True}
    first = client.completions.create(model=MODEL, prompt=head, max_tokens=12, temperature=0,
                                      extra_body={**extra, "keyacc": {"route": "gpu"}})
    assert first.choices[0].token_ids == ref_ids(head, 12)
    counters = ("keyacc_kv_handoff_recomputed_tokens_total", "keyacc_kv_tier_hits_total")
    recomputed, hits = (replica_counter(app_url, c, "CpuDecode") for c in counters)
    follow = head + " And the next question?"
    r = client.completions.create(model=MODEL, prompt=follow, max_tokens=12, temperature=0,
                                  extra_body={**extra, "keyacc": {"route": "stage"}})
    assert r.choices[0].token_ids == ref_ids(follow, 12)
    segments = r.model_extra["keyacc"]["segments"]
    assert [s["pool"] for s in segments] == ["gpu", "cpu"] and segments[1].get("kv_skipped_tokens", 0) >= 64, segments
    deadline = time.monotonic() + 20  # (the replicas' next load reports)
    while time.monotonic() < deadline and replica_counter(app_url, counters[1], "CpuDecode") < hits + 64:
        time.sleep(0.3)
    assert replica_counter(app_url, counters[1], "CpuDecode") >= hits + 64  # the head, from the node's tier
    assert replica_counter(app_url, counters[0], "CpuDecode") < recomputed + 64  # not computed again
