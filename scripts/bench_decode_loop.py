#!/usr/bin/env python3
"""The CPU fast path's decode step with its loop over the layers in C++ (`decode_layers`, the
default where every product is packed) against the same step looping in Python
(`kernels/fused_step.py`), ms a step, alone and beside a thread that holds the GIL part of the
time without using a core (as a replica's busy event loop holds it between its awaits: it calls
libc's usleep through ctypes.PyDLL, which keeps the GIL). Steps alternate between the two loops,
so both see the same contexts; medians of --steps steps each.

    python scripts/bench_decode_loop.py --model models/bench-qwen3 --batch 1 8 32
    KEYACC_CPU_ISA=avx2 python scripts/bench_decode_loop.py --batch 1
    python scripts/bench_decode_loop.py --model models/medium-qwen3 --dtype float32 --threads 1

The last line is one JSON object: {"b1": {"python_ms": .., "native_ms": .., "python_gil_ms": ..,
"native_gil_ms": ..}, ...}.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class GilHolder:
    """A thread that holds the GIL `hold_us` out of every `hold_us + free_us`, using no core."""

    def __init__(self, hold_us: int, free_us: int):
        self.hold_us, self.free_s = hold_us, free_us / 1e6
        self._stop = threading.Event()
        self._lib = ctypes.PyDLL(None)
        self._th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._lib.usleep(self.hold_us)
            time.sleep(self.free_s)

    def __enter__(self):
        self._th.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._th.join()


def measure(model: str, batch: int, steps: int, threads: int, hold_us: int, free_us: int,
            dtype: str = "bfloat16") -> dict:
    import torch

    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    torch.set_num_threads(threads)
    eng = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=max(8, batch),
                                 max_model_len=128 + 3 * steps + 16, num_threads=threads, cpu_kernels="on"))
    fs = eng.runner.fused_step
    if fs is None or fs.native is None:
        raise SystemExit(f"{model}: no fused step with the native loop here ({eng.runner.fast_path.summary()})")
    native = fs.native
    rng = random.Random(0)
    vocab = eng.runner.vocab_size
    for i in range(batch):
        eng.add_request(f"d{i}", [rng.randrange(10, vocab - 1) for _ in range(128)],
                        SamplingParams(max_tokens=3 * steps + 8, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()

    def run() -> dict:
        times: dict = {"python": [], "native": []}
        for i in range(2 * steps):
            mode = ("python", "native")[i % 2]
            fs.native = native if mode == "native" else None
            t = time.perf_counter()
            eng.step()
            times[mode].append(time.perf_counter() - t)
        fs.native = native
        return {k: round(sorted(v)[len(v) // 2] * 1e3, 2) for k, v in times.items()}

    alone = run()
    with GilHolder(hold_us, free_us):
        held = run()
    return {"python_ms": alone["python"], "native_ms": alone["native"],
            "python_gil_ms": held["python"], "native_gil_ms": held["native"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "bench-qwen3"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20, help="steps of each loop per measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", help="float32: plain weights, torch's own products in the loop")
    ap.add_argument("--hold-us", type=int, default=200, help="the GIL holder's hold, of every hold + free")
    ap.add_argument("--free-us", type=int, default=300)
    args = ap.parse_args()
    out = {}
    print(f"{'batch':>5} {'python ms':>10} {'native ms':>10} {'python, GIL held':>17} {'native, GIL held':>17}")
    for b in args.batch:
        r = out[f"b{b}"] = measure(args.model, b, args.steps, args.threads, args.hold_us, args.free_us, args.dtype)
        print(f"{b:>5} {r['python_ms']:>10} {r['native_ms']:>10} {r['python_gil_ms']:>17} {r['native_gil_ms']:>17}",
              flush=True)
    out["gil_held_fraction"] = round(args.hold_us / (args.hold_us + args.free_us), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
