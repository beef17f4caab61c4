#!/usr/bin/env python3
"""The serving stack's CPU per request, route by route: starts the bench's graph (emulated GPU
pools on CPU 0, CPU pool on CPU 1), then runs a closed loop pinned to each route (`gpu`: prefill
and decode on the GPU pools, one KV hand-off between them; `stage`: GPU prefill, CPU decode;
`cpu`: the whole request on the CPU pool) and an idle window, and prints the cores each
component used. Stack = everything but the engine replicas (ingress, router, monitor,
controller, the rest of Ray, this load generator); per request = (stack - idle stack) / req/s.

    python scripts/route_cost.py                      # the stack floating over both cores
    python scripts/route_cost.py --stack-cpus 1       # the stack on the CPU pool's core
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
from keyacc_ray.bench import cpu_account  # noqa: E402
from keyacc_ray.bench.loadgen import Workload, closed_loop  # noqa: E402


def measure(url: str, model: str, route: str | None, clients: int, seconds: float, wl: Workload) -> dict:
    before, t0 = cpu_account.snapshot(), time.time()
    ok = 0
    if clients:
        res, _ = asyncio.run(closed_loop(url, model, clients, seconds, wl, extra={"keyacc": {"route": route}}))
        ok = sum(r.ok for r in res)
    else:
        time.sleep(seconds)
    wall = time.time() - t0
    cores = cpu_account.delta(before, cpu_account.snapshot(), wall)
    stack = sum(v for k, v in cores.items() if k not in cpu_account.ENGINES)
    return {"route": route or "idle", "clients": clients, "req_per_s": round(ok / wall, 3),
            "stack_cores": round(stack, 3), "cores": cores}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients per route (the GPU pool runs 4)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--stack-cpus", type=int, nargs="*", default=None, help="as scripts/bench.py")
    ap.add_argument("--port", type=int, default=8021)
    args = ap.parse_args()
    bench_args = ["--port", str(args.port)] + (["--stack-cpus", *map(str, args.stack_cpus)] if args.stack_cpus else [])
    url = bench.start(bench.parser().parse_args(bench_args))
    model, wl = bench.MODEL_NAME, Workload(prompt_tokens=64, output_tokens=96)
    asyncio.run(closed_loop(url, model, 2, 5, wl))  # warm-up
    runs = [measure(url, model, None, 0, args.seconds, wl)]
    for route in ("gpu", "stage", "cpu"):
        runs.append(measure(url, model, route, args.clients, args.seconds, wl))
    idle = runs[0]["stack_cores"]
    for r in runs:
        if r["req_per_s"]:
            r["stack_ms_per_request"] = round(1e3 * (r["stack_cores"] - idle) / r["req_per_s"], 1)
            r["stack_ms_per_token"] = round(r["stack_ms_per_request"] / wl.output_tokens, 3)
        print(json.dumps(r), flush=True)
    from ray import serve
    import ray

    serve.shutdown()
    ray.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
