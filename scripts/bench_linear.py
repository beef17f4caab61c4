#!/usr/bin/env python3
"""GFLOP/s of the CPU fast path's bf16 linear kernel alone, per forced kernel path.

One subprocess per path (`KEYACC_CPU_ISA` is read once per process), 2 threads by default, the best
of --reps calls of each product (3 for products wider than 100,000 outputs). Shapes: the bench
shape's batch-32 products ([32 x 1024] x [1024 x 6144], [32 x 3072] x [3072 x 1024]) and its
vocabulary's ([32 x 1024] x [1024 x 151936]), then the same at 8 rows.

    python scripts/bench_linear.py --isa avx2 portable

The last line is one JSON object: {"<isa>": {"MxKxN": GFLOP/s, ...}, ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = [(32, 1024, 6144), (32, 3072, 1024), (32, 1024, 151936), (8, 1024, 6144), (8, 1024, 151936)]


def child(reps: int) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import torch

    from keyacc_ray import kernels

    K = kernels.load()
    assert K is not None, kernels.unavailable_reason()
    g = torch.Generator().manual_seed(0)
    out = {}
    for m, k, n in SHAPES:
        packed = K.pack_bf16((torch.randn(n, k, generator=g) * 0.05).bfloat16())
        x = torch.randn(m, k, generator=g).bfloat16()
        K.linear_bf16(x, packed, n, None)
        best = float("inf")
        for _ in range(3 if n > 100_000 else reps):
            t = time.perf_counter()
            K.linear_bf16(x, packed, n, None)
            best = min(best, time.perf_counter() - t)
        out[f"{m}x{k}x{n}"] = round(2 * m * k * n / best / 1e9, 1)
    return out


def run_per_isa(script: str, isa: str, args: list[str], timeout: int = 900) -> dict:
    """`script --child ARGS` in a process of its own with KEYACC_CPU_ISA=isa (read once per
    process): its last output line as JSON, or {"error": [its last error line]}."""
    env = {**os.environ, "KEYACC_CPU_ISA": isa}
    p = subprocess.run([sys.executable, script, "--child", *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", nargs="+", default=["avx2", "portable"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(child(args.reps)))
        return
    res = {}
    for isa in args.isa:
        res[isa] = run_per_isa(__file__, isa, ["--threads", str(args.threads), "--reps", str(args.reps)])
        print(isa, res[isa], flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
