#!/usr/bin/env python3
"""CPU decode throughput: one engine on all cores vs one pinned engine per core group.

On a multi-socket server the groups are the NUMA nodes (each engine's threads and KV memory
local to its node, so their memory bandwidth adds up); on this 2-core box two groups of one
core stand in for two sockets. Each setup decodes the same total batch (split across the
groups) for the same number of steps; prints aggregate tokens/s of both and their ratio.

    python scripts/bench_numa.py --model models/medium-qwen3 --batch 16 --steps 48
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(model: str, dtype: str, cpus: list[int], batch: int, steps: int, start, ready, out) -> None:
    from keyacc_ray.hw.pinning import pin_process

    pin_process(cpus)  # before torch starts its thread pool
    import torch

    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    torch.set_num_threads(len(cpus))
    eng = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=batch, max_model_len=512))
    rng = random.Random(cpus[0])
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(10, 500) for _ in range(64)], params)
    while eng.scheduler.num_waiting:
        eng.step()
    eng.step()
    ready.put(cpus)
    start.wait()
    t = time.perf_counter()
    n = sum(len(eng.step()) for _ in range(steps))
    out.put((n, time.perf_counter() - t))


def run(model, dtype, groups, batch, steps) -> float:
    ctx = mp.get_context("spawn")
    start, ready, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    per = batch // len(groups)
    procs = [ctx.Process(target=worker, args=(model, dtype, g, per, steps, start, ready, out)) for g in groups]
    for p in procs:
        p.start()
    for _ in procs:  # every engine loaded and prefilled: decode together
        ready.get(timeout=600)
    start.set()
    res = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sum(n for n, _ in res) / max(dt for _, dt in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/medium-qwen3")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    from keyacc_ray.hw.topology import numa_nodes

    cpus = sorted(os.sched_getaffinity(0))
    nodes = numa_nodes()
    groups = [n.cpus for n in nodes] if len(nodes) > 1 else [[c] for c in cpus]
    one = run(args.model, args.dtype, [cpus], args.batch, args.steps)
    split = run(args.model, args.dtype, groups, args.batch, args.steps)
    res = {"model": args.model, "batch": args.batch, "groups": groups, "one_replica_all_cores_tok_s": round(one, 1),
           "one_pinned_replica_per_group_tok_s": round(split, 1), "ratio": round(split / one, 3)}
    for k, v in res.items():
        print(f"{k:<36} {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
