#!/usr/bin/env python3
"""The engine's host time per decode step, this tree against an older commit, in one process.

This VM's speed drifts by up to 2x over tens of seconds, more than most host-side changes move
the figure, so runs of bench_host.py one after the other cannot tell them apart. Here the older
commit's `keyacc_ray` is copied out of git under another package name and both engines run in
one process (two engines of each), each with its batch decoding, taking steps in turn: both see
the same moments. The same code against itself gave ratios of 0.89-1.01 at batch 64 and
0.96-1.01 at 256 (three runs of 4 rounds): a difference smaller than that is not shown by one
run. Both engines run this tree's compiled kernels (the other package's `kernels` is this
tree's), so the comparison is of the Python side (scheduling, inputs, sampling's Python,
postprocessing, detokenization); compare kernels with their own benchmarks.

    python scripts/ab_host.py --against HEAD~1 --batch 64 256 --modes greedy qwen3 topp penalties

Prints, per (batch, mode), the median host ms of each engine over rounds x steps decode steps and
their ratio (this tree / the other), then one JSON line.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_host import MODES  # noqa: E402


def other_package(commit: str, into: Path) -> str:
    """The commit's keyacc_ray copied into `into` as package keyacc_ab (its imports renamed)."""
    data = subprocess.run(["git", "archive", commit, "keyacc_ray"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    os.rename(into / "keyacc_ray", into / "keyacc_ab")
    for py in (into / "keyacc_ab").rglob("*.py"):  # (and its attention's name in transformers' registry)
        text = re.sub(r"\bkeyacc_ray\b", "keyacc_ab", py.read_text())
        py.write_text(text.replace('"keyacc_paged"', '"keyacc_ab_paged"'))
    # its kernels are this tree's (built once; a second build of other sources would take the
    # build folder both share, and one process holds one such module)
    (into / "keyacc_ab" / "kernels" / "__init__.py").write_text(
        '"""ab_host.py: this tree\'s compiled kernels."""\nfrom keyacc_ray import kernels as _this\n\n\n'
        "def __getattr__(name):\n    return getattr(_this, name)\n")
    return "keyacc_ab"


def engine(pkg: str, model: str):
    config = __import__(f"{pkg}.config", fromlist=["EngineConfig"])
    llm = __import__(f"{pkg}.engine.llm_engine", fromlist=["LLMEngine"])
    request = __import__(f"{pkg}.engine.request", fromlist=["SamplingParams"])
    eng = llm.LLMEngine(config.EngineConfig(model=model, dtype="float32", max_num_seqs=256, max_model_len=256,
                                            num_kv_blocks=256 * 64 // 16))
    return eng, request.SamplingParams


class Timed:
    """An engine whose steps' host ms are taken: the step's time less its model forward (the
    fused decode step, or the model's own forward, timed out)."""

    def __init__(self, eng, params_cls):
        self.eng, self.params_cls, self.spent = eng, params_cls, 0.0
        run = eng.runner
        self.target, self.name = (run, "fused_step") if getattr(run, "fused_step", None) is not None \
            else (run.model, "forward")
        inner = getattr(self.target, self.name)

        def timed(*a, **k):
            t = time.perf_counter()
            out = inner(*a, **k)
            self.spent += time.perf_counter() - t
            return out

        setattr(self.target, self.name, timed)

    def start(self, batch: int, mode: str, max_tokens: int, rng: random.Random) -> None:
        """`batch` new 32-token prompts, every one prefilled (as bench_host.py's)."""
        eng = self.eng
        params = self.params_cls(max_tokens=max_tokens, ignore_eos=True, seed=1, **MODES[mode])
        for _ in range(batch):
            eng.add_request(f"ab{rng.random()}", [rng.randrange(eng.runner.vocab_size) for _ in range(32)], params)
        while eng.scheduler.num_waiting or any(s.num_cached == 0 for s in eng.seqs.values()):
            eng.step()

    def step(self) -> float:
        self.spent = 0.0
        t = time.perf_counter()
        self.eng.step()
        return (time.perf_counter() - t - self.spent) * 1e3

    def stop(self) -> None:
        for rid in list(self.eng.seqs):
            self.eng.abort(rid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the other commit (anything git rev-parse takes)")
    ap.add_argument("--model", default="models/tiny-qwen3")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="keyacc-ab-") as tmp:
        sys.path.insert(0, tmp)
        other_pkg = other_package(args.against, Path(tmp))
        # two engines of each, made in the order this, other, other, this (an engine made earlier
        # ran the same code a few % faster, whichever package it was: the pairs cancel that)
        engines = [(name, Timed(*engine("keyacc_ray" if name == "this" else other_pkg, args.model)))
                   for name in ("this", "other", "other", "this")]
        got: dict[tuple, list[float]] = {}
        for rnd in range(args.rounds):
            for b in args.batch:
                for mode in args.modes:
                    order = engines if rnd % 2 == 0 else engines[::-1]
                    for _, e in order:
                        e.start(b, mode, args.steps + 8, random.Random(rnd))
                    for _ in range(args.steps):  # a step of each in turn: the same moments for all
                        for name, e in order:
                            got.setdefault((b, mode, name), []).append(e.step())
                    for _, e in order:
                        e.stop()
    res = {}
    for b in args.batch:
        for mode in args.modes:
            this, other = (statistics.median(got[(b, mode, n)]) for n in ("this", "other"))
            key = f"host_ms_b{b}_{mode}"
            res[key] = {"this": round(this, 3), "other": round(other, 3), "ratio": round(this / other, 3)}
            print(f"{key:<24} this {this:7.3f}   {args.against} {other:7.3f}   ratio {this / other:.2f}")
    print(json.dumps({"against": args.against, **res}))


if __name__ == "__main__":
    main()
