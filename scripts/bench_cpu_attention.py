#!/usr/bin/env python3
"""The CPU decode-attention kernel alone (`paged_decode_attention`), per forced kernel path: the
bench shape's attention (16 query heads, 8 KV heads, head size 128, bf16, blocks of 16 keys),
batch 32 (and 1), every row at the same context length, each row's blocks scattered over a pool
as a serving engine's are after a while. Prints ms per call, the K/V bytes it reads over that time
(GB/s), and that against this machine's 2-thread read bandwidth (bench_engine.py's measure): the
kernel's share of a step is memory-bound once the rows hold long contexts (at batch 32 and 1k
tokens a step of the 24-layer bench model reads 3.2 GB of K/V against 0.8 GB of weights).

    python scripts/bench_cpu_attention.py --isa amx avx2 portable

One subprocess per path (`KEYACC_CPU_ISA` is read once per process); best of --reps calls. The
last line is one JSON object: {"read_gbs": ..., "<isa>": {"b<B>_ctx<L>": {"ms": .., "gbs": ..}}}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CASES = [(32, 150), (32, 1000), (32, 4000), (1, 4000)]
H, HKV, D, BS = 16, 8, 128, 16


def child(reps: int) -> dict:
    sys.path.insert(0, ROOT)
    import torch

    from keyacc_ray import kernels

    K = kernels.load()
    assert K is not None, kernels.unavailable_reason()
    g = torch.Generator().manual_seed(0)
    out = {"isa": K.isa()}
    for b, ctx in CASES:
        per = -(-ctx // BS)
        nb = b * per + 16
        kp = torch.randn(nb, HKV, BS, D, generator=g).bfloat16()
        vp = torch.randn(nb, HKV, BS, D, generator=g).bfloat16()
        tables = torch.randperm(nb, generator=g)[:b * per].view(b, per).to(torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int64)
        q = torch.randn(b, H, 1, D, generator=g).bfloat16()
        K.paged_decode_attention(q, kp, vp, tables, lens, 0, D ** -0.5)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            K.paged_decode_attention(q, kp, vp, tables, lens, 0, D ** -0.5)
            best = min(best, time.perf_counter() - t)
        nbytes = 2 * b * HKV * ctx * D * 2
        out[f"b{b}_ctx{ctx}"] = {"ms": round(best * 1e3, 3), "gbs": round(nbytes / best / 1e9, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", nargs="+", default=["amx", "avx2", "portable"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(child(args.reps)))
        return
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_engine import read_bandwidth_gbs
    from bench_linear import run_per_isa

    res: dict = {"read_gbs": round(read_bandwidth_gbs(args.threads), 1)}
    print(f"read bandwidth, {args.threads} threads: {res['read_gbs']} GB/s", flush=True)
    for isa in args.isa:
        res[isa] = run_per_isa(__file__, isa, ["--threads", str(args.threads), "--reps", str(args.reps)])
        for case, r in res[isa].items():
            if isinstance(r, dict):
                r["of_read"] = round(r["gbs"] / res["read_gbs"], 2)
        print(isa, res[isa], flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
