#!/usr/bin/env python3
"""What the node's shared KV tier costs (keyacc_ray/engine/node_tier.py).

1. The tier alone, on its directory's file system: per block written into a full tier (its
   evictions included), found (`in`) and read, wall and CPU (user, system) time in microseconds.
2. An engine with and without the tier, alternated: CPU per request (the process's, the tier's
   writer thread included) for requests whose blocks are all new (random prompts: every block
   written, none read back: the tier's worst case).

    python scripts/bench_node_tier.py
    python scripts/bench_node_tier.py --model models/bench-qwen3 --requests 64 --prompt 512
    python scripts/bench_node_tier.py --kv-blocks 160 --host-disk   # evictions down host and disk tiers every step

Its last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyacc_ray.bench.cpu_account import own_cpu_s  # noqa: E402
from keyacc_ray.engine.node_tier import NodeTier  # noqa: E402


def tier_alone(root: str, block_bytes: int, n: int) -> dict:
    d = tempfile.mkdtemp(prefix="keyacc-bench-node-", dir=root)
    try:
        t = NodeTier(d, "f", block_bytes, budget_bytes=max(64, n // 4) * block_bytes)
        row = np.zeros(block_bytes, np.uint8)
        keys = [i.to_bytes(16, "little") for i in range(n)]
        out = {}
        for name, op in (("write", lambda k: k in t or t.put(k, row)), ("find", lambda k: k in t),
                         ("read", t.get)):
            c0, w0 = os.times(), time.perf_counter()
            for k in keys:
                op(k)
            c1, w1 = os.times(), time.perf_counter()
            out[name] = {"wall_us": round((w1 - w0) / n * 1e6, 1), "user_us": round((c1.user - c0.user) / n * 1e6, 1),
                         "sys_us": round((c1.system - c0.system) / n * 1e6, 1)}
        out["evictions"] = t.evictions
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def engine_cpu(model: str, node_dir: str | None, requests: int, prompt: int, output: int, seqs: int,
               private: dict | None = None) -> dict:
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    extra = {"kv_node_tier_gb": 0.25, "kv_node_tier_dir": node_dir} if node_dir else {}
    eng = LLMEngine(EngineConfig(model=model, max_num_seqs=seqs, num_threads=1, max_waiting=max(256, requests),
                                 **extra, **(private or {})))
    rng = random.Random(0)
    vocab = min(eng.runner.vocab_size, 30000)
    p = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)

    def run(n: int) -> None:
        for i in range(n):
            eng.add_request(f"r{time.monotonic_ns()}-{i}", [rng.randrange(10, vocab) for _ in range(prompt)], p)
        while eng.has_unfinished():
            eng.step()
        if eng.tiers is not None and eng.tiers.node is not None:
            eng.tiers.node.flush()

    run(max(2, requests // 8))  # warm
    c0, w0 = own_cpu_s(), time.perf_counter()
    run(requests)
    c1, w1 = own_cpu_s(), time.perf_counter()
    res = {"cpu_ms_per_request": round((c1 - c0) / requests * 1e3, 3), "wall_s": round(w1 - w0, 3)}
    if eng.tiers is not None and eng.tiers.node is not None:
        res["blocks_written"] = eng.tiers.stored["node"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir(),
                    help="where the tier's directory goes (default /dev/shm)")
    ap.add_argument("--block-bytes", type=int, default=8192, help="part 1: one block's bytes (tiny-qwen3: 8 KiB)")
    ap.add_argument("--blocks", type=int, default=4000)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--output", type=int, default=36)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="part 2: off / on pairs")
    ap.add_argument("--host-disk", action="store_true",
                    help="part 2: with --kv-blocks, host and disk tiers under the pool in both configurations "
                         "(the soak's --tiers shape: evictions every step)")
    ap.add_argument("--kv-blocks", type=int, default=None, help="part 2: the engine's block pool (default: sized by RAM)")
    args = ap.parse_args()

    out = {"tier": tier_alone(args.dir, args.block_bytes, args.blocks)}
    print(json.dumps({"tier": out["tier"]}), flush=True)
    private = {"num_kv_blocks": args.kv_blocks} if args.kv_blocks else {}
    if args.host_disk:  # (the soak's: 64 host blocks, 4096 disk blocks of 8 KiB)
        private.update(kv_host_tier_gb=64 * 8192 / 2**30, kv_disk_tier_gb=4096 * 8192 / 2**30)
    off, on = [], []
    for _ in range(args.rounds):
        off.append(engine_cpu(args.model, None, args.requests, args.prompt, args.output, args.seqs, private))
        d = tempfile.mkdtemp(prefix="keyacc-bench-node-", dir=args.dir)
        try:
            on.append(engine_cpu(args.model, d, args.requests, args.prompt, args.output, args.seqs, private))
        finally:
            shutil.rmtree(d, ignore_errors=True)
        print(json.dumps({"off": off[-1], "on": on[-1]}), flush=True)
    med = lambda xs: sorted(x["cpu_ms_per_request"] for x in xs)[len(xs) // 2]  # noqa: E731
    out.update({"engine_cpu_ms_per_request_off": med(off), "engine_cpu_ms_per_request_on": med(on),
                "blocks_written_per_request": round(on[-1]["blocks_written"] / (args.requests + max(2, args.requests // 8)), 2),
                "model": args.model, "requests": args.requests, "prompt": args.prompt, "output": args.output,
                "private_tiers": private})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
