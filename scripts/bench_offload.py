#!/usr/bin/env python3
"""Offload policies against GPU-only, side by side, in one run on this box.

Starts the Serve graph once (a ~33M-parameter float32 model; GPU pools pinned to CPU 0 with an
emulated KV budget, the CPU pool pinned to CPU 1), then for each policy (switched in place, no
restart) runs the same closed-loop streaming workload at each concurrency level, and prints:
output tokens/s at the highest level, and the highest concurrency whose p99 TTFT and p99 TPOT
meet the objective, each as a ratio to gpu_only. Results also go to JSON.

    python scripts/bench_offload.py                     # defaults below; about 6 minutes here
    python scripts/bench_offload.py --levels 4 8 16 --duration 20 --out results/offload.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyacc_ray.bench.loadgen import Workload, closed_loop, summarize  # noqa: E402

POLICIES = ["gpu_only", "full_offload", "stage_offload", "auto"]


def start(args):
    import ray
    from ray import serve

    from keyacc_ray.serve.app import build_app

    model = ROOT / "models" / "medium-qwen3"
    if not (model / "config.json").exists():
        import subprocess

        subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_model.py"), "--size", "medium",
                        "--out", str(model)], check=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    cfg = {
        "model": str(model), "max_model_len": 1024, "policy": "gpu_only",
        "gpu": {"device": "auto", "max_num_seqs": 8, "num_kv_blocks": args.gpu_kv_blocks, "num_threads": 1,
                "num_cpus": 0.5, "cpu_affinity": [0]},
        "cpu": {"device": "cpu", "max_num_seqs": 32, "num_threads": 1, "num_cpus": 0.5, "cpu_affinity": [1]},
    }
    serve.run(build_app(cfg), name="keyacc", route_prefix="/")
    return f"http://127.0.0.1:{args.port}"


def set_policy(name: str, options: dict) -> None:
    from ray import serve

    serve.get_deployment_handle("Router", "keyacc").reconfigure.remote(
        {"policy": name, "policy_options": options}).result(timeout_s=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 6, 12, 20])
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--gpu-kv-blocks", type=int, default=40, help="emulated GPU KV budget (16-token blocks)")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000)
    ap.add_argument("--tpot-slo-ms", type=float, default=150)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--period", type=int, default=32, help="CPU decode period (tokens)")
    ap.add_argument("--out", default=str(ROOT / "results" / "offload.json"))
    args = ap.parse_args()

    url = start(args)
    wl = Workload(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)
    opts = {"trigger_window_s": 0.3, "return_window_s": 1.0, "decode_period_tokens": args.period}
    runs: dict = {}
    for pol in args.policies:
        set_policy(pol, {} if pol == "gpu_only" else opts)
        runs[pol] = {}
        asyncio.run(closed_loop(url, "medium-qwen3", 2, 3, wl))  # warm up
        for c in args.levels:
            res, wall = asyncio.run(closed_loop(url, "medium-qwen3", c, args.duration, wl))
            s = summarize(res, wall, args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
            runs[pol][c] = s
            print(f"{pol:<14} c={c:<3} tok/s={s['output_tok_per_s']:<7} req/s={s['req_per_s']:<6} "
                  f"ttft p99={s['ttft_p99_ms']:<8} tpot p99={s['tpot_p99_ms']:<7} share={s['token_share']} "
                  f"moves={s['moves']} failed={s['failed']}", flush=True)

    def within(pol):
        ok = [c for c, s in runs[pol].items() if s["failed"] == 0 and s["ttft_p99_ms"] <= args.ttft_slo_ms
              and s["tpot_p99_ms"] <= args.tpot_slo_ms]
        return max(ok) if ok else 0

    top = max(args.levels)
    base_tps = runs["gpu_only"][top]["output_tok_per_s"] if "gpu_only" in runs else None
    base_c = within("gpu_only") if "gpu_only" in runs else None
    summary = {}
    for pol in runs:
        tps = runs[pol][top]["output_tok_per_s"]
        summary[pol] = {"output_tok_per_s_at_top": tps, "max_concurrency_within_slo": within(pol),
                        "throughput_ratio": round(tps / base_tps, 3) if base_tps else None,
                        "concurrency_ratio": round(within(pol) / base_c, 3) if base_c else None}
    print(json.dumps({"slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}, "summary": summary}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))
    from ray import serve
    import ray

    serve.shutdown()
    ray.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
