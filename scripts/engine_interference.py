#!/usr/bin/env python3
"""Do the two engines of the bench slow each other through shared cache and memory? Decodes a
batch on CPU 1 alone, then again while a second engine decodes on CPU 0 (the emulated GPU's
core), and prints tokens/s of both CPU 1 runs. Bench model (models/medium-qwen3), one thread each.

    python scripts/engine_interference.py --seconds 15
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def decode(cpu: int, batch: int, seconds: float) -> float:
    os.sched_setaffinity(0, {cpu})
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    eng = LLMEngine(EngineConfig(model=str(ROOT / "models/medium-qwen3"), max_num_seqs=batch, max_model_len=1024,
                                 num_threads=1))
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", list(range(10, 74)), params)
    for _ in range(5):
        eng.step()
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        n += len(eng.step())
    return n / (time.time() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--worker", nargs=3, type=float, help=argparse.SUPPRESS)  # cpu batch seconds
    args = ap.parse_args()
    if args.worker:
        cpu, batch, secs = args.worker
        print(f"{decode(int(cpu), int(batch), secs):.1f}", flush=True)
        return

    def run(cpu, batch, secs):
        return subprocess.Popen([sys.executable, __file__, "--worker", str(cpu), str(batch), str(secs)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    alone = float(run(1, 32, args.seconds).communicate()[0])
    neighbour = run(0, 4, args.seconds * 3)  # busy on CPU 0 the whole time
    time.sleep(10)  # its model loaded and decoding
    shared = float(run(1, 32, args.seconds).communicate()[0])
    neighbour.kill()
    print(f"CPU 1, batch 32: alone {alone:.1f} tokens/s; with an engine decoding on CPU 0: {shared:.1f} tokens/s")


if __name__ == "__main__":
    main()
