#!/usr/bin/env python3
"""The side-by-side report: gpu_only, full_offload, stage_offload and auto on the same
workload at a sweep of concurrency levels, plus the CPU pool alone, in one run on this box;
concurrency gain and harvest efficiency per policy; JSON and PNG plots.

Starts the Serve graph once (a ~33M-parameter float32 Qwen3-shaped model; the "GPU" pools are
emulated on CPU 0 with a KV budget of --gpu-kv-blocks, the CPU pool on CPU 1) and switches
policies in place (the Router's `reconfigure`, no restart). Without --url it starts and stops
its own Ray; with --url it measures a running keyacc-ray server (policy switching then needs
--ray-address of that cluster).

    python scripts/bench.py --quick                  # under 15 minutes here
    python scripts/bench.py --levels 2 8 16 24 40 --duration 20 --out-dir results/full

Its last line of output is one JSON object with harvest_efficiency and concurrency_gain.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyacc_ray.bench import side_by_side  # noqa: E402
from keyacc_ray.bench.loadgen import Workload, append_results  # noqa: E402
from keyacc_ray.bench.plots import plot_report  # noqa: E402

MODEL_NAME = "medium-qwen3"


def app_config(args, model: Path) -> dict:
    cfg = _gpu_host(args, model) if args.gpu else _this_box(args, model)
    for pool in ("gpu", "cpu"):
        cfg[pool]["batched_prefill"] = not args.no_batched_prefill
    cfg["stream_mux"] = not args.no_mux
    if args.trace_steps:  # keyacc_ray/engine/step_trace.py: every step of every pool replica
        from keyacc_ray.engine.step_trace import ENV as TRACE_ENV
        from keyacc_ray.serve.app import REPLICA_ENV

        cfg["replica_env"] = {**cfg.get("replica_env", REPLICA_ENV), TRACE_ENV: str(Path(args.trace_steps).resolve())}
    if args.profile_steps:  # keyacc_ray/serve/step_profile.py, in every pool replica
        from keyacc_ray.serve.app import REPLICA_ENV
        from keyacc_ray.serve.step_profile import ENV

        cfg["replica_env"] = {**cfg.get("replica_env", REPLICA_ENV), ENV: args.profile_steps}
    return cfg


def _gpu_host(args, model: Path) -> dict:  # one GPU engine on GPU 0 (colocated), the CPU pool on the remaining cores
    cpu_threads = max(1, (os.cpu_count() or 4) - 4)
    return {
        "model": str(model), "dtype": "bfloat16", "max_model_len": 2048, "policy": "gpu_only",
        "gpu": {"device": "cuda", "max_num_seqs": args.gpu_seqs, "num_kv_blocks": None, "num_gpus": 1,
                "num_cpus": 1, "num_threads": 1, "gpu_memory_utilization": 0.85,
                "stream_interval_ms": args.stream_interval_ms},
        "cpu": {"device": "cpu", "max_num_seqs": 16, "num_threads": cpu_threads, "num_cpus": cpu_threads,
                "stream_interval_ms": args.stream_interval_ms},
    }


def _this_box(args, model: Path) -> dict:  # the "GPU" pools emulated on CPU 0, the CPU pool on CPU 1
    return {
        "model": str(model), "max_model_len": 1024, "policy": "gpu_only",
        "gpu": {"device": "auto", "max_num_seqs": 8, "num_kv_blocks": args.gpu_kv_blocks, "num_threads": 1,
                "kv_allocation": args.gpu_kv_allocation,
                "num_cpus": 0.5, "cpu_affinity": [0], "stream_interval_ms": args.stream_interval_ms},
        "cpu": {"device": "cpu", "max_num_seqs": args.cpu_seqs, "num_threads": 1, "num_cpus": 0.5, "cpu_affinity": [1],
                "stream_interval_ms": args.stream_interval_ms, "max_prefill_tokens": args.cpu_prefill_tokens},
    }


def start(args) -> str:
    model = Path(args.model_path) if args.model_path else ROOT / "models" / MODEL_NAME
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_model.py"), "--size", "medium",
                        "--out", str(model)], check=True)
    if args.stack_cpus:
        # Ray, Serve, the router, ingress and this load generator start here and inherit this
        # mask; the pools pin themselves (the CPU pool's cores are its own).
        os.sched_setaffinity(0, set(args.stack_cpus))
    return serve_app(app_config(args, model), args.port, None if args.gpu else 2)


def serve_app(cfg: dict, port: int, num_cpus: int | None) -> str:
    """A local Ray cluster with the cluster env, and the app of `cfg` on it as "keyacc"; its URL."""
    import ray
    from ray import serve

    from keyacc_ray.serve.app import apply_cluster_env, build_app

    apply_cluster_env()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name="keyacc", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def policy_switcher(options: dict):
    import threading

    from ray import serve

    # One event loop for the driver's handle calls (with RAY_SERVE_THROUGHPUT_OPTIMIZED a handle
    # needs a running loop and stays bound to it).
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="bench-handles").start()

    async def call(name: str) -> None:
        handle = serve.get_deployment_handle("Router", "keyacc")
        await handle.reconfigure.remote({"policy": name, "policy_options": {} if name == "gpu_only" else options})

    def set_policy(name: str) -> None:
        asyncio.run_coroutine_threadsafe(call(name), loop).result(timeout=30)
        time.sleep(0.5)  # let the previous policy's in-flight work settle

    return set_policy


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="levels 2 8 24 40, 10 s each: under 15 minutes here")
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 8, 16, 24, 40],
                    help="concurrency levels; the top one should saturate both pools (here: 4 GPU + 32 CPU slots)")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per run, after --ramp")
    ap.add_argument("--ramp", type=float, default=4.0,
                    help="seconds each run goes before its measured window (every client sends at once)")
    ap.add_argument("--low-load-rounds", type=int, default=10,
                    help="interleaved low-load rounds (each starts with another policy); 10 give each policy's p50 "
                         "about 50 requests (with 4, about 20, the p50s of identical paths drifted 5-7%% apart)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--prompt-spread", type=float, default=0.0,
                    help="prompt lengths uniform in --prompt-tokens * (1 +- spread); seeded, the same for every run")
    ap.add_argument("--output-spread", type=float, default=0.0,
                    help="output lengths likewise (fixed lengths keep every client in step: see docs/benchmarks.md)")
    ap.add_argument("--gpu-kv-blocks", type=int, default=40, help="emulated GPU KV budget (16-token blocks)")
    ap.add_argument("--gpu-kv-allocation", choices=("lazy", "reserve"), default="lazy",
                    help="the emulated GPU pool's KV allocation (EngineConfig.kv_allocation)")
    ap.add_argument("--timeline-policy", default="auto",
                    help="the policy whose run at the top level is recorded as the timeline plot (none: no "
                         "timeline; its /metrics scrape every 0.5 s takes CPU from the cell it samples)")
    ap.add_argument("--order", choices=["policy", "level"], default="policy",
                    help="policy: each policy through every level in turn; level: every policy at each level, "
                         "rotated, before the next level (the cells a figure compares run minutes closer)")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000)
    ap.add_argument("--tpot-slo-ms", type=float, default=150)
    ap.add_argument("--policies", nargs="+", default=side_by_side.POLICIES)
    ap.add_argument("--period", type=int, default=32, help="CPU decode period (tokens)")
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--url", help="measure a running server instead of starting one")
    ap.add_argument("--ray-address", help="with --url: the cluster to reconfigure the Router on")
    ap.add_argument("--model", default=None, help="the served model name (default: the model folder's name)")
    ap.add_argument("--model-path", help="model to serve (default: models/medium-qwen3, made if missing)")
    ap.add_argument("--gpu", action="store_true", help="a real GPU host: GPU pools on CUDA, CPU pool on the other cores")
    ap.add_argument("--gpu-seqs", type=int, default=32, help="with --gpu: sequences per GPU replica")
    ap.add_argument("--cpu-seqs", type=int, default=32, help="the CPU pool's max_num_seqs (this box)")
    ap.add_argument("--no-batched-prefill", action="store_true", help="one forward per new prompt (an A/B)")
    ap.add_argument("--cpu-prefill-tokens", type=int, default=4096,
                    help="the CPU pool's prompt tokens admitted per engine step (PoolConfig.max_prefill_tokens)")
    ap.add_argument("--no-mux", action="store_true", help="one Serve stream per hop (stream_mux: false; an A/B)")
    ap.add_argument("--stream-interval-ms", type=float, default=5.0, help="pools' stream interval (see README)")
    ap.add_argument("--stack-cpus", type=int, nargs="*", default=None,
                    help="CPUs for Ray, Serve, router, ingress and the load generator (default: they float over "
                         "every core). `--stack-cpus 1` puts them on the CPU pool's core in every run, leaving the "
                         "emulated GPU's core to the GPU pools, as a GPU runs no host code (docs/benchmarks.md)")
    ap.add_argument("--trace-steps", metavar="DIR", help="every engine step of every pool replica (rows, tokens, "
                    "wall and thread CPU) to DIR/steps-<pid>.jsonl: scripts/step_trace_report.py")
    ap.add_argument("--profile-steps", metavar="DIR[:SKIP[:COUNT]]",
                    help="torch.profiler over COUNT engine steps of every pool replica -> DIR/steps-<pid>.txt")
    ap.add_argument("--requests", action="store_true", help="every measured request (its token times and the "
                    "server's trace: where it ran, when each segment started, where its tokens waited) to "
                    "OUT/requests.jsonl")
    ap.add_argument("--out-dir", default=None, help="default results/bench-<time>")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.quick:
        args.levels, args.duration = [2, 8, 24, 40], 10.0
    args.model = args.model or (Path(args.model_path).name if args.model_path else MODEL_NAME)

    out = Path(args.out_dir or ROOT / "results" / time.strftime("bench-%Y%m%d-%H%M%S"))
    if args.url:
        import ray

        ray.init(address=args.ray_address or "auto", namespace="serve")
        url = args.url
    else:
        url = start(args)
    options = {"trigger_window_s": 0.3, "return_window_s": 1.0, "decode_period_tokens": args.period}
    plan = side_by_side.Plan(levels=args.levels, duration_s=args.duration, ramp_s=args.ramp, policies=args.policies,
                             ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                             low_load_rounds=args.low_load_rounds, timeline_policy=args.timeline_policy,
                             order=args.order)
    wl = Workload(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                  prompt_spread=args.prompt_spread, output_spread=args.output_spread)
    t0 = time.time()
    from keyacc_ray.bench import cpu_account

    out.mkdir(parents=True, exist_ok=True)

    def checkpoint(partial: dict) -> None:  # report.json as it grows: a run cut short still has figures
        (out / "report.json").write_text(json.dumps(partial, indent=1))

    report = side_by_side.run(url, args.model, wl, plan, policy_switcher(options), options,
                              log=lambda m: print(m, flush=True),
                              cpu_probe=lambda: cpu_account.snapshot(engine_threads=True),
                              checkpoint=checkpoint,
                              keep=functools.partial(append_results, out / "requests.jsonl") if args.requests else None)
    report["wall_s"] = round(time.time() - t0, 1)
    report["box"] = {"cpus": os.cpu_count(), "gpu": ("as served" if args.url else "CUDA (see env.json)" if args.gpu
                                                     else "emulated on CPU 0"), "config": None if args.url else
                     app_config(args, Path(args.model_path or ROOT / "models" / MODEL_NAME)),
                     "stack_cpus": None if args.url else (args.stack_cpus or "all")}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    files = plot_report(report, out, title="keyacc-ray policies, this box")
    print(f"report: {out / 'report.json'}; plots: {', '.join(f.name for f in files)}", flush=True)
    if not args.url:
        from ray import serve
        import ray

        serve.shutdown()
        ray.shutdown()
    last = {k: report[k] for k in ("harvest_efficiency", "concurrency_gain", "throughput_gain", "low_load")}
    last["harvest_model"] = report.get("harvest_model")  # what the stack's cost predicts (side_by_side)
    last["cpu_alone_tok_per_s"] = report["cpu_alone"]["output_tok_per_s"] if report["cpu_alone"] else None
    # the serving stack's CPU per streamed token (what keeps harvest down on a small box)
    top = max(args.levels)
    last["stack_ms_per_token"] = {p: r[top].get("stack_ms_per_token") for p, r in report["runs"].items()}
    if report["cpu_alone"]:
        last["stack_ms_per_token"]["cpu_alone"] = report["cpu_alone"].get("stack_ms_per_token")
    last["report"] = str(out / "report.json")
    print(json.dumps(last), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
