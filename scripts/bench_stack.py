#!/usr/bin/env python3
"""The serving stack alone (issue #22): the real graph (HTTP proxy, ingress, router, monitor, the
pools' Serve side and engine loops) with every pool's engine replaced by a TOKEN SOURCE, a
benchmark stand-in that emits a token per sequence every 1/--token-rate seconds and costs no CPU
(keyacc_ray/bench/token_source.py), and N streaming clients at each level. Per level: streamed
tokens/s, and the CPU every server process used (cores, by component) and per streamed token
(`stack_ms_per_token`; the load generator's own CPU is reported, not counted), and p50 TTFT (the
request's way through the stack and back, plus at most a token's interval). Then the idle
server's cores. Its last line is one JSON object.

    python scripts/bench_stack.py                       # levels 8 40 64, 15 s each
    python scripts/bench_stack.py --levels 64 --seconds 30 --token-rate 400
    python scripts/bench_stack.py --levels 1 --token-rate 2000   # TTFT: the stack's own request path
                                                                 # (the first token within 0.5 ms)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyacc_ray.bench import cpu_account  # noqa: E402
from keyacc_ray.bench.loadgen import Workload, closed_loop, summarize  # noqa: E402


def app_config(args) -> dict:
    from keyacc_ray.serve.app import REPLICA_ENV

    pool = {"max_num_seqs": 512, "max_ongoing_requests": 1024, "num_cpus": 0.5, "num_threads": 1,
            "stream_interval_ms": args.stream_interval_ms}
    return {"model": str(ROOT / "models" / "tiny-qwen3"), "max_model_len": 1024, "policy": "gpu_only",
            "ingress_replicas": args.ingress_replicas, "max_queued_requests": 4096, "stream_mux": not args.no_mux,
            "gpu": {**pool, "device": "auto", "num_kv_blocks": 64}, "cpu": {**pool, "device": "cpu"},
            "replica_env": {**REPLICA_ENV, "KEYACC_TOKEN_SOURCE": str(args.token_rate)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[8, 40, 64])
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per level (after --ramp)")
    ap.add_argument("--ramp", type=float, default=3.0)
    ap.add_argument("--token-rate", type=float, default=200.0, help="tokens/s per sequence the stand-in emits")
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--ingress-replicas", type=int, default=1)
    ap.add_argument("--stream-interval-ms", type=float, default=5.0)
    ap.add_argument("--no-mux", action="store_true", help="one Serve stream per hop (stream_mux: false)")
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=8041)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    if not (ROOT / "models" / "tiny-qwen3" / "config.json").exists():
        import subprocess
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), "--arch", "qwen3", "--size",
                        "tiny", "--out", str(ROOT / "models" / "tiny-qwen3")], check=True)
    url = bench.serve_app(app_config(args), args.port, 2)
    wl = Workload(prompt_tokens=16, output_tokens=args.output_tokens)
    out: dict = {"token_rate_per_seq": args.token_rate, "ingress_replicas": args.ingress_replicas,
                 "stream_mux": not args.no_mux, "levels": {}}
    asyncio.run(closed_loop(url, "tiny-qwen3", 4, 3.0, wl, desc="warm-up"))
    for c in args.levels:
        res, wall = asyncio.run(closed_loop(url, "tiny-qwen3", c, args.ramp, wl, desc=f"ramp c={c}"))
        before, t0 = cpu_account.snapshot(), time.monotonic()
        res, wall = asyncio.run(closed_loop(url, "tiny-qwen3", c, args.seconds, wl, desc=f"c={c}"))
        cores = cpu_account.delta(before, cpu_account.snapshot(), time.monotonic() - t0)
        s = summarize(res, wall, 60.0, 60.0)
        tok_s = s["output_tok_per_s"]
        stack = sum(v for k, v in cores.items() if k != "load_generator")
        out["levels"][c] = {"streamed_tokens_per_s": tok_s, "offered_tokens_per_s": round(c * args.token_rate, 1),
                            "stack_cores": round(stack, 3),
                            "stack_ms_per_token": round(1e3 * stack / tok_s, 4) if tok_s else None,
                            "cores": cores, "failed": s["failed"], "itl_p50_ms": s["itl_p50_ms"],
                            "itl_p99_ms": s["itl_p99_ms"], "ttft_p50_ms": s["ttft_p50_ms"]}
        print(f"c={c:<3} streamed {tok_s:8.1f} tok/s (offered {c * args.token_rate:.0f})  stack {stack:.2f} cores "
              f"= {out['levels'][c]['stack_ms_per_token']} ms/token  itl p50/p99 {s['itl_p50_ms']}/{s['itl_p99_ms']} ms"
              f"  ttft p50 {s['ttft_p50_ms']} ms"
              f"  load generator {cores.get('load_generator', 0):.2f} cores  {cores}", flush=True)
    time.sleep(3.0)
    before, t0 = cpu_account.snapshot(), time.monotonic()
    time.sleep(args.idle_seconds)
    idle = cpu_account.delta(before, cpu_account.snapshot(), time.monotonic() - t0)
    out["idle_cores"] = round(sum(v for k, v in idle.items() if k != "load_generator"), 3)
    out["idle_by_component"] = idle
    top = max(args.levels)
    out["stack_ms_per_token"] = out["levels"][top]["stack_ms_per_token"]
    out["streamed_tokens_per_s"] = max(v["streamed_tokens_per_s"] for v in out["levels"].values())
    from ray import serve
    import ray

    serve.shutdown()
    ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
