#!/usr/bin/env python3
"""GFLOP/s of the CPU fast path's bf16 linear kernel alone, per forced kernel path.

One subprocess per path (`KEYACC_CPU_ISA` is read once per process), 2 threads by default, the best
of --reps calls of each product (3 for products wider than 100,000 outputs). Shapes: the bench
shape's batch-32 products ([32 x 1024] x [1024 x 6144], [32 x 3072] x [3072 x 1024]) and its
vocabulary's ([32 x 1024] x [1024 x 151936]), then the same at 8 rows.

    python scripts/bench_linear.py --isa avx2 portable

The last line is one JSON object: {"<isa>": {"MxKxN": GFLOP/s, ...}, ...}.

Those weights stay in the L3 between calls; a decode step reads every weight from DRAM. `--stream`
measures that instead: the products of a whole 24-layer step of the bench shape (q|k|v, o,
gate|up, down: 755 MB of bf16 weights, far beyond any L3) at 1, 8, 16 and 32 input rows, best of
4 steps, ms per step (the read roofline is the weights over the read bandwidth):

    python scripts/bench_linear.py --isa amx --stream     # {"amx": {"rows1_ms": .., "rows32_ms": ..}}
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


STREAM_SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # one layer's (in, out)
STREAM_ROWS = (1, 8, 16, 32)


def child_stream() -> dict:
    """ms per 24-layer step of products, weights streamed from DRAM (see --stream)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import torch

    from keyacc_ray import kernels

    K = kernels.load()
    assert K is not None, kernels.unavailable_reason()
    g = torch.Generator().manual_seed(0)
    layers = [[(K.pack_bf16((torch.randn(n, k, generator=g) * 0.05).bfloat16()), k, n) for k, n in STREAM_SHAPES]
              for _ in range(24)]
    out = {"weight_mb": round(sum(k * n * 2 for k, n in STREAM_SHAPES) * 24 / 1e6)}
    for m in STREAM_ROWS:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k, _ in STREAM_SHAPES}
        best = float("inf")
        for _ in range(4):
            t = time.perf_counter()
            for layer in layers:
                for packed, k, n in layer:
                    K.linear_bf16(xs[k], packed, n, None)
            best = min(best, time.perf_counter() - t)
        out[f"rows{m}_ms"] = round(best * 1e3, 1)
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
    ap.add_argument("--stream", action="store_true", help="a decode step's products, weights from DRAM (ms)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(child_stream() if args.stream else child(args.reps)))
        return
    res = {}
    for isa in args.isa:
        res[isa] = run_per_isa(__file__, isa, ["--threads", str(args.threads), "--reps", str(args.reps)]
                               + (["--stream"] if args.stream else []))
        print(isa, res[isa], flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
