#!/usr/bin/env python3
"""Hand-off latency at idle: one request at a time through the default graph on the tiny model,
each moved between pools by a pinned route, streamed.

Routes: `stage` (prefill on the GPU engine, decode on the CPU pool), `stage` with
`migrate_back_after` (GPU -> CPU -> GPU), `cpu` with `migrate_back_after` (CPU -> GPU). Per
request: each hand-off's `handoff_ms` from the response's trace (the end of a hop to the start of
the next: export, object store, the next pool's call) and the longest gap between two streamed
events (what the client sees at the move). The first request of a fresh app is reported on its
own (`first_*`): it pays what start-up left for it. Starts its own Ray and Serve app.

    python scripts/bench_handoff.py                  # 8 requests per route
    python scripts/bench_handoff.py --requests 20

Its last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import APP_ARGS, free_port, start_app, stop_app  # noqa: E402
from tests.helpers import PROMPTS  # noqa: E402

ROUTES = {"stage": {"route": "stage"}, "stage_back": {"route": "stage", "migrate_back_after": 8},
          "cpu_back": {"route": "cpu", "migrate_back_after": 8}}


def one(base: str, i: int, keyacc: dict) -> tuple[list[float], float]:
    prompt = f"[{i} {time.monotonic_ns()}] " + " ".join(PROMPTS[:9])
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "keyacc": keyacc, "stream": True}
    t0, times, trace = time.perf_counter(), [], None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                times.append(time.perf_counter() - t0)
                trace = d.get("keyacc") or trace
    handoffs = [s["handoff_ms"] for s in trace["segments"] if "handoff_ms" in s]
    gap = max((b - a for a, b in zip(times, times[1:])), default=0.0) * 1e3
    return handoffs, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="per route, after the first request")
    args = ap.parse_args()
    base = start_app(APP_ARGS, free_port())
    out: dict = {}
    try:
        first_handoffs, first_gap = one(base, -1, ROUTES["stage"])
        out["first_handoff_ms"], out["first_max_gap_ms"] = round(first_handoffs[0], 1), round(first_gap, 1)
        print(json.dumps({"first": out}), flush=True)
        for name, keyacc in ROUTES.items():
            hs, gaps = [], []
            for i in range(args.requests):
                h, g = one(base, i, keyacc)
                hs += h
                gaps.append(g)
            res = {"handoffs": len(hs), "handoff_ms_p50": round(statistics.median(hs), 1),
                   "handoff_ms_max": round(max(hs), 1), "max_gap_ms_p50": round(statistics.median(gaps), 1)}
            out[name] = res
            print(json.dumps({name: res}), flush=True)
    finally:
        stop_app()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
