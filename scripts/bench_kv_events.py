#!/usr/bin/env python3
"""What the engines' KV events cost (keyacc_ray/engine/kv_events.py): the CPU an engine spends
per request with and without them (its hooks, and the drain a replica's report thread runs every
REPORT_EVERY_S, here after every step), alternated; the events per request; the monitor's log
and the router's prefix view per event.

    python scripts/bench_kv_events.py
    python scripts/bench_kv_events.py --kv-blocks 160 --host-disk   # evictions down host and disk tiers every step

Its last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyacc_ray.bench.cpu_account import own_cpu_s  # noqa: E402


def engine_cpu(eng, events: bool, requests: int, prompt: int, output: int, rng) -> tuple[float, list]:
    """CPU ms per request over `requests` random prompts; the events drained after every step."""
    from keyacc_ray.engine.request import SamplingParams

    eng.blocks.events = eng.kv_events if events else None
    if eng.tiers is not None:
        eng.tiers.events = eng.kv_events if events else None
    vocab = min(eng.runner.vocab_size, 30000)
    p = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    told = []
    c0 = own_cpu_s()
    for i in range(requests):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", [rng.randrange(10, vocab) for _ in range(prompt)], p)
    while eng.has_unfinished():
        eng.step()
        if events:
            told += eng.kv_events.drain()
    return (own_cpu_s() - c0) / requests * 1e3, told


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--output", type=int, default=36)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="off / on pairs")
    ap.add_argument("--kv-blocks", type=int, default=None, help="the engine's block pool (default: sized by RAM)")
    ap.add_argument("--host-disk", action="store_true", help="the soak's host and disk tiers under the pool")
    args = ap.parse_args()

    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.serve.monitor import LoadState, ReplicaReport
    from keyacc_ray.serve.prefix_affinity import PoolPrefixes

    private = {"num_kv_blocks": args.kv_blocks} if args.kv_blocks else {}
    if args.host_disk:
        private.update(kv_host_tier_gb=64 * 8192 / 2**30, kv_disk_tier_gb=4096 * 8192 / 2**30)
    eng = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.seqs, num_threads=1,
                                 max_waiting=max(256, args.requests), **private))
    assert eng.kv_events is not None
    rng = random.Random(0)
    engine_cpu(eng, True, max(2, args.requests // 8), args.prompt, args.output, rng)  # warm
    off, on, told = [], [], []
    for _ in range(args.rounds):
        off.append(engine_cpu(eng, False, args.requests, args.prompt, args.output, rng)[0])
        ms, events = engine_cpu(eng, True, args.requests, args.prompt, args.output, rng)
        on.append(ms)
        told = events
        print(json.dumps({"off_ms": round(off[-1], 3), "on_ms": round(on[-1], 3), "events": len(events)}), flush=True)

    # the monitor's log and the router's view, per event (this run's last round's events)
    state, prefixes = LoadState(), PoolPrefixes()
    prefixes.live("cpu_decode/0", ["r1"])
    batches = [told[i:i + 64] for i in range(0, len(told), 64)]
    c0 = time.perf_counter()
    for b in batches:
        r = ReplicaReport("CpuDecode", "cpu", "decode", "r1", 0, 0, 0, 0, 16, 8, 0.0, 0, False, "cpu")
        r.kv_events = b
        state.report(r)
    c1 = time.perf_counter()
    snap = state.snapshot(kv_after=None)
    for dep, replica, key, tier in snap.kv_events:
        pass
    c2 = time.perf_counter()
    prefixes.observe("cpu_decode/0", "r1", told)
    c3 = time.perf_counter()
    n = max(1, len(told))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(json.dumps({"engine_cpu_ms_per_request_off": round(med(off), 3),
                      "engine_cpu_ms_per_request_on": round(med(on), 3),
                      "events_per_request": round(len(told) / args.requests, 2),
                      "monitor_us_per_event": round((c1 - c0) / n * 1e6, 2),
                      "snapshot_us_per_event": round((c2 - c1) / n * 1e6, 2),
                      "router_us_per_event": round((c3 - c2) / n * 1e6, 2),
                      "model": args.model, "requests": args.requests, "prompt": args.prompt, "output": args.output,
                      "private_tiers": private}))


if __name__ == "__main__":
    main()
