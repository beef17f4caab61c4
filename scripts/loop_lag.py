#!/usr/bin/env python3
"""How long a CPU replica's event loop waits while its engine thread steps (not part of `make test`).

A pool replica runs its engine on a thread and its Serve side (the hops it takes, its token
streams, its heartbeats) on an asyncio loop in the same process: the loop runs only while the
engine thread lets the GIL go. This runs the CPU engine (the fast path's C++ kernels) on a thread
as a replica does, on a stream of prompts of --prompt tokens beside --batch decoding rows, while
the loop sleeps 1 ms at a time and records how late each wake-up is. Prints the lateness
percentiles and the engine's steps, then one JSON line.

    python scripts/loop_lag.py --model models/bench-qwen3 --seconds 10
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from keyacc_ray.config import EngineConfig  # noqa: E402
from keyacc_ray.engine.llm_engine import LLMEngine  # noqa: E402
from keyacc_ray.engine.request import SamplingParams  # noqa: E402


def run_engine(engine: LLMEngine, prompt: int, batch: int, stop: threading.Event, steps: list) -> None:
    params = SamplingParams(max_tokens=engine.config.max_model_len - 32, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", [100 + i] * 16, params)
    n = 0
    while not stop.is_set():
        if not engine.scheduler.waiting:  # a new prompt as soon as the last one went through
            n += 1
            engine.add_request(f"p{n}", [(7 * n + j) % 5000 + 10 for j in range(prompt)], short)
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)


async def measure(seconds: float) -> list[float]:
    late = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        t = loop.time()
        await asyncio.sleep(0.001)
        late.append(loop.time() - t - 0.001)
    return late


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-qwen3")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of each new request")
    ap.add_argument("--batch", type=int, default=8, help="rows decoding all along")
    ap.add_argument("--threads", type=int, default=None, help="the engine's torch threads (default: all cores)")
    args = ap.parse_args()
    cfg = EngineConfig(model=args.model, device="cpu", dtype="bfloat16", max_num_seqs=args.batch + 4,
                       max_model_len=max(4096, args.prompt + 64), num_threads=args.threads,
                       enable_prefix_caching=False)
    engine = LLMEngine(cfg)
    stop, steps = threading.Event(), []
    th = threading.Thread(target=run_engine, args=(engine, args.prompt, args.batch, stop, steps), daemon=True)
    th.start()
    time.sleep(1.0)  # past the first steps' warm-up
    steps.clear()
    late = asyncio.run(measure(args.seconds))
    stop.set()
    th.join()
    if not steps:
        sys.exit("the engine made no step (its thread failed: see above)")
    late.sort()
    pick = lambda q: round(late[min(len(late) - 1, int(q * len(late)))] * 1e3, 2)  # noqa: E731
    out = {"model": args.model, "prompt": args.prompt, "batch": args.batch, "wakeups": len(late),
           "late_ms_p50": pick(0.5), "late_ms_p99": pick(0.99), "late_ms_max": round(late[-1] * 1e3, 2),
           "engine_steps": len(steps), "step_ms_max": round(max(steps) * 1e3, 1) if steps else None,
           "step_ms_mean": round(sum(steps) / len(steps) * 1e3, 1) if steps else None}
    print(f"loop wake-ups {out['wakeups']}: late p50 {out['late_ms_p50']} ms, p99 {out['late_ms_p99']} ms, "
          f"max {out['late_ms_max']} ms; engine steps {out['engine_steps']} (mean {out['step_ms_mean']} ms, "
          f"longest {out['step_ms_max']} ms)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
