#!/usr/bin/env python3
"""Host CPU per generated token of the GPU decode replica, with the model's compute taken out
(the tiny model on the emulated GPU pool, CPU 0): what the engine loop, sampling, detokenizing
and Serve streaming cost per token, the part a GPU does not speed up. Optionally a py-spy
profile of the replica (raw folded stacks) for where it goes.

    python scripts/bench_pool_host.py --clients 32 [--py-spy out.txt] [--model-path models/tiny-qwen3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--model-path", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--stream-interval-ms", type=float, default=5.0)
    ap.add_argument("--py-spy", help="write a py-spy raw profile of the GpuDecode replica here")
    ap.add_argument("--port", type=int, default=8031)
    args = ap.parse_args()

    import psutil
    import ray
    from ray import serve

    from bench import serve_app
    from keyacc_ray.bench import cpu_account
    from keyacc_ray.bench.loadgen import Workload, closed_loop, summarize

    cfg = {"model": args.model_path, "max_model_len": 512, "policy": "gpu_only",
           "gpu": {"device": "auto", "max_num_seqs": max(64, args.clients), "num_kv_blocks": 4000, "num_threads": 1,
                   "num_cpus": 0.5, "cpu_affinity": [0], "stream_interval_ms": args.stream_interval_ms},
           "cpu": {"device": "cpu", "max_num_seqs": 4, "num_threads": 1, "num_cpus": 0.5,
                   "cpu_affinity": [1 % (os.cpu_count() or 1)]}}
    url, name = serve_app(cfg, args.port, 2), Path(args.model_path).name
    wl = Workload(prompt_tokens=32, output_tokens=args.output_tokens)
    asyncio.run(closed_loop(url, name, 4, 3, wl))  # warm-up
    pid = next(p.pid for p in psutil.process_iter(["cmdline"]) if "GpuDecode" in " ".join(p.info["cmdline"] or []))
    spy = None
    if args.py_spy:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        spy = subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(int(args.seconds * 0.7)), "-r", "200",
                                "-f", "raw", "-o", args.py_spy, "--threads"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before = cpu_account.snapshot()
    res, wall = asyncio.run(closed_loop(url, name, args.clients, args.seconds, wl))
    cores = cpu_account.delta(before, cpu_account.snapshot(), wall)
    s = summarize(res, wall, 10, 10)
    rate = max(s["output_tok_per_s"], 1e-9)
    print(json.dumps({"clients": args.clients, "output_tok_per_s": s["output_tok_per_s"],
                      "tpot_p50_ms": s["tpot_p50_ms"], "failed": s["failed"],
                      "gpu_decode_host_ms_per_token": round(cores.get("gpu_decode", 0.0) * 1e3 / rate, 3),
                      "ingress_ms_per_token": round(cores.get("ingress", 0.0) * 1e3 / rate, 3),
                      "cores_used": cores}), flush=True)
    if spy:
        spy.wait(timeout=60)
    serve.shutdown()
    ray.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
