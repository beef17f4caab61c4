"""The engines' KV events through the Serve graph (real Ray, HTTP, engines): the router learns that
the CPU pool let a head go (other prompts took its blocks), and a stage hand-off of a request
with that head then carries all of its KV instead of leaving the head out for the CPU pool to
compute again (what the router's guess from where prompts ran alone would do for 120 s)."""
from __future__ import annotations

import random
import time

import httpx

from tests.e2e.conftest import replica_counter
from tests.e2e.test_openai_api import MODEL, ref_ids
from tests.helpers import PROMPTS


def told(app_url: str, tier: str) -> float:
    """The router's count of the CPU pool's KV events of a tier."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{app_url}/metrics", timeout=10).text.splitlines()
               if line.startswith("keyacc_kv_events_total{") and 'pool="cpu"' in line and f'tier="{tier}"' in line)


def wait_until(fn, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.3)
    return fn()


def ask(app_url: str, prompt, route: str, max_tokens: int = 2) -> dict:
    r = httpx.post(f"{app_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "keyacc": {"route": route}})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_head_the_cpu_pool_let_go_is_carried_by_the_next_hand_off_there(app_url):
    head = f"[kv events {time.monotonic_ns()}] " + " ".join(PROMPTS[:8]) + " "
    series = [("keyacc_kv_handoff_skipped_tokens_total", "GpuDecode"),
              ("keyacc_kv_handoff_recomputed_tokens_total", "CpuDecode")]
    stored = told(app_url, "device")
    ask(app_url, head + "first", "cpu")  # the CPU pool computes the head and caches it
    assert wait_until(lambda: told(app_url, "device") > stored)

    # the control: a stage hand-off to the CPU pool leaves the cached head out
    before = [replica_counter(app_url, *s) for s in series]
    body = ask(app_url, head + "second", "stage", 6)
    assert body["choices"][0]["token_ids"] == ref_ids(head + "second", 6)
    assert wait_until(lambda: replica_counter(app_url, *series[0]) > before[0])
    assert replica_counter(app_url, *series[1]) == before[1]

    # other prompts take every block of the CPU pool: the head is let go, and the router hears it
    blocks = replica_counter(app_url, "keyacc_total_kv_blocks", "CpuDecode")
    assert 0 < blocks <= 2048, blocks
    gone = told(app_url, "gone")
    rng = random.Random(7)
    n = 47 * 16  # tokens a filler (47 blocks, within the 768-token context)
    for _ in range(int(blocks // 47) + 2):
        ask(app_url, [rng.randrange(10, 500) for _ in range(n)], "cpu", 1)
    assert wait_until(lambda: told(app_url, "gone") >= gone + 4)
    # until the news has all arrived: the count still for longer than an idle router's refresh
    # (2 s) and a replica's report (0.2 s) (/metrics shows what the router counted as it took it)
    last, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline and (now := told(app_url, "gone")) != last:
        last = now
        time.sleep(2.5)

    before = [replica_counter(app_url, *s) for s in series]
    body = ask(app_url, head + "third", "stage", 6)
    assert body["choices"][0]["token_ids"] == ref_ids(head + "third", 6)
    assert [s["pool"] for s in body["keyacc"]["segments"]] == ["gpu", "cpu"]
    time.sleep(3.0)  # the replicas' reports reach /metrics within a second or two
    after = [replica_counter(app_url, *s) for s in series]
    assert after == before, (before, after)  # nothing left out, nothing computed again
