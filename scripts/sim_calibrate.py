#!/usr/bin/env python3
"""Fit the simulator's step-time model (keyacc_ray/sim/steptime.py) for one device from the real
engine's own steps: LLMEngine.step() timed on a grid of prompt chunks, decode batches and
context lengths, then least squares (steptime.fit) of

    t = L(prompt tokens + decode rows: piecewise linear through each decode batch measured, then
          b_prefill a token) + b_decode x decode rows + b_prefill_attn x prompt attention pairs
          + b_kv x KV tokens read

Writes the profile (with each measured point's relative residual) as JSON and prints it; its
last line is one JSON object: the coefficients, the knots, `residual_mean`, `residual_max`.

    python scripts/sim_calibrate.py --model models/medium-qwen3 --device cpu --threads 1 \\
        --out keyacc_ray/sim/profiles/this-box-medium-cpu.json
    python scripts/sim_calibrate.py --model models/bench-qwen3 --device cuda --name h200-bench   # GPU host
    python scripts/sim_calibrate.py --refit results/X/profile.json --out /tmp/p.json   # fit stored points again
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from keyacc_ray.sim.steptime import fit  # noqa: E402

PREFILLS = (32, 128, 512)
# Every decode batch from 1 to 32 rows: a step's time is a staircase in its rows, not a line (the
# CPU kernels work in blocks of rows; this Xeon: 1-3 rows 11.5 ms, 4-6 18-20, 12 31, 15 36, 16 30,
# the AMX path's whole tiles). Knots only at 1, 2, 4, 8, 16, 24, 32 read 3 rows 35% slow and 9-15
# 10-20% fast, the rows the GPU pool and the CPU pool each run at most here (docs/benchmarks.md).
DECODES = tuple((r, 64) for r in range(1, 33)) + ((1, 384), (8, 384), (16, 384), (32, 384))  # (rows, context)
MIXED = ((8, 64, 64), (31, 64, 64), (16, 128, 128), (31, 128, 256))  # (rows decoding, their context, a prompt joining)


def measure(args) -> list[dict]:
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    if args.cpu_affinity is not None:
        os.sched_setaffinity(0, set(args.cpu_affinity))
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_threads=args.threads,
                       max_num_seqs=max(r for r, _ in DECODES), max_model_len=1024, enable_prefix_caching=False,
                       num_kv_blocks=args.num_kv_blocks)
    eng = LLMEngine(cfg)
    sync = (lambda: __import__("torch").cuda.synchronize()) if args.device == "cuda" else (lambda: None)
    points, n = [], [0]

    def rid() -> str:
        n[0] += 1
        return f"c{n[0]}"

    def prompt(k: int) -> list[int]:
        return [(7 * i + n[0]) % 200 + 10 for i in range(k)]

    def timed_step(before=None) -> float:
        """One engine step's seconds (after `before()`, untimed: a prompt joining)."""
        if before:
            before()
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        return time.perf_counter() - t

    def running(rows: int, ctx: int, max_tokens: int) -> list[str]:
        """`rows` sequences of `ctx` prompt tokens, prefilled (untimed), decoding from now on."""
        ids = [rid() for _ in range(rows)]
        for r in ids:
            eng.add_request(r, prompt(ctx), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        while any(s.num_cached < s.num_prompt_tokens for s in eng.seqs.values()):
            eng.step()
        return ids

    def join(p: int):
        return lambda: eng.add_request(rid(), prompt(p), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))

    def point(p: int, rows: int, kv: int, times: list[float]) -> None:
        points.append({"prefill_tokens": p, "decode_rows": rows, "kv_tokens": kv, "seconds": statistics.median(times)})

    for p in PREFILLS:  # one prompt, fed in one step (its first token made); the first run warms up
        point(p, 0, 0, [timed_step(join(p)) for _ in range(args.reps + 1)][1:])
    for rows, ctx in DECODES:  # rows sequences at about ctx tokens, decoding together
        ids = running(rows, ctx, args.reps + 3)
        eng.step()  # the first decode step (warm)
        point(0, rows, rows * (ctx + 2), [timed_step() for _ in range(args.reps)])
        for r in ids:
            eng.abort(r)
    for rows, ctx, p in MIXED:  # a prompt's prefill in the same step as running decodes (continuous batching)
        running(rows, ctx, 4 * args.reps + 8)
        point(p, rows, rows * (ctx + args.reps), [timed_step(join(p)) for _ in range(args.reps)])
        for r in list(eng.seqs):
            eng.abort(r)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "medium-qwen3"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-affinity", type=int, nargs="*", default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--name", default=None, help="the profile's name (default: the --out file's stem)")
    ap.add_argument("--refit", metavar="PROFILE", help="fit the points a profile file holds again; measure nothing")
    ap.add_argument("--out", default=None, help="write the profile here (e.g. keyacc_ray/sim/profiles/NAME.json)")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").exists() and Path(args.model).name == "medium-qwen3":
        subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_model.py"), "--size", "medium", "--out",
                        args.model], check=True)
    if args.refit:  # the points another run measured, fitted again (by this version of the fit)
        old = json.loads(Path(args.refit).read_text())
        points, source = old["points"], old["source"] + " (refitted)"
    else:
        points = measure(args)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        source = (f"scripts/sim_calibrate.py --model {Path(args.model).name} --device {args.device} "
                  f"--threads {args.threads} at {commit}")
    name = args.name or (Path(args.out).stem if args.out else f"{Path(args.model).name}-{args.device}")
    st = fit(points, name, source)
    res = list(st.residuals.values())
    prof = {**st.to_dict(), "points": points}
    for p, r in zip(points, res):
        print(f"prefill {p['prefill_tokens']:4d}  rows {p['decode_rows']:3d}  kv {p['kv_tokens']:6d}  "
              f"{p['seconds'] * 1e3:9.2f} ms  residual {r:+.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(prof, indent=1) + "\n")
    print(json.dumps({"name": name, "b0": st.b0, "b_prefill": st.b_prefill, "b_prefill_attn": st.b_prefill_attn,
                      "b_decode": st.b_decode, "b_kv": st.b_kv, "token_knots": st.token_knots,
                      "residual_mean": round(float(np.mean(np.abs(res))), 4),
                      "residual_max": round(float(np.max(np.abs(res))), 4)}))

if __name__ == "__main__":
    main()
