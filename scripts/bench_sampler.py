#!/usr/bin/env python3
"""Per-row cost of the engine's sampler on a real-sized vocabulary, on CPU: what every sampled
(or penalised) sequence pays per decode step, besides the model.

    python scripts/bench_sampler.py                    # 151,936 tokens (Qwen's vocabulary)
    python scripts/bench_sampler.py --vocab 32000 --batch 32

Each case runs the torch path (what CUDA runs) and, where the C++ kernels are built, the CPU
kernel the engine uses on CPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from keyacc_ray.engine.request import SamplingParams  # noqa: E402
from keyacc_ray import kernels  # noqa: E402
from keyacc_ray.engine.sampling import Sampler  # noqa: E402

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top_k 20, top_p 0.95, T 0.6 (Qwen3's defaults)": dict(temperature=0.6, top_k=20, top_p=0.95),
    "top_p 0.95, T 0.7": dict(temperature=0.7, top_p=0.95),
    "min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "greedy + repetition_penalty 1.05": dict(temperature=0.0, repetition_penalty=1.05),
    "Qwen2.5's (T 0.7, top_k 20, top_p 0.8, repetition 1.05) + presence 0.5":
        dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, presence_penalty=0.5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--history", type=int, default=1000, help="tokens so far per sequence (penalties read them)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    # logits shaped like a language model's: a few likely tokens, a long flat tail
    logits = torch.randn(args.batch, args.vocab) * 3
    history = [torch.randint(0, args.vocab, (args.history,)).tolist() for _ in range(args.batch)]
    print(f"vocab {args.vocab}, batch {args.batch}, history {args.history} tokens, torch threads "
          f"{torch.get_num_threads()}")
    mod = kernels.load()
    paths = {"torch": None, **({"kernel": mod} if mod is not None else {})}
    print(f"{'case':48s} " + "  ".join(f"{p + ' ms/row':>14s}" for p in paths))
    for name, kw in CASES.items():
        cells = []
        for path, k in paths.items():
            s = Sampler(k)
            rids = [f"r{i}" for i in range(args.batch)]
            params = [SamplingParams(seed=i, **kw).validate() for i in range(args.batch)]
            for r, p in zip(rids, params):
                s.add(r, p)
            hist = [list(h) for h in history]
            s.sample(logits, rids, params, history=lambda i: (hist[i], 10, (0,)))  # warm up
            t = time.perf_counter()
            for step in range(args.steps):
                for i, h in enumerate(hist):  # each sequence's history grows by a token a step, as in decoding
                    h.append((step * 7919 + i) % args.vocab)
                s.sample(logits, rids, params, history=lambda i: (hist[i], 10, (0,)))
            cells.append((time.perf_counter() - t) / args.steps * 1e3 / args.batch)
        print(f"{name:48s} " + "  ".join(f"{c:14.4f}" for c in cells))  # (a small vocabulary: a few us a row)

if __name__ == "__main__":
    main()
