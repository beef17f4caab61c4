#!/usr/bin/env python3
"""Our load generator and GuideLLM (an established one, `pip install guidellm`, kept out of the
project's dependencies) against the same server, same workload, one after the other, and
their figures side by side.

    python -m venv /tmp/gllm && /tmp/gllm/bin/pip install guidellm
    python scripts/compare_guidellm.py --guidellm /tmp/gllm/bin/guidellm --concurrency 8 --duration 20

Starts the same graph as scripts/bench.py (policy gpu_only) unless --url is given.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from keyacc_ray.bench.loadgen import Workload, closed_loop, summarize  # noqa: E402


def guidellm_figures(path: Path) -> dict:
    """The few figures we compare, from GuideLLM's JSON report (its schema moves between
    releases; look the keys up defensively)."""
    rep = json.loads(path.read_text())
    b = rep["benchmarks"][0]
    m = b["metrics"]

    def stat(name, field="successful"):
        d = m.get(name, {})
        d = d.get(field, d)
        return {k: d.get(k) for k in ("mean", "median")} | {"p99": (d.get("percentiles") or {}).get("p99")}

    return {"output_tokens_per_second": stat("output_tokens_per_second"),
            "time_to_first_token_ms": stat("time_to_first_token_ms"),
            "time_per_output_token_ms": stat("time_per_output_token_ms"),
            "inter_token_latency_ms": stat("inter_token_latency_ms"),
            "requests_per_second": stat("requests_per_second"),
            "request_totals": b.get("request_totals") or m.get("request_totals")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--guidellm", default="guidellm")
    ap.add_argument("--url")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--out-dir", default=str(ROOT / "results" / "guidellm"))
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ROOT / "models" / "medium-qwen3"
    if not args.url:
        import bench

        bench_args = argparse.Namespace(gpu=False, model_path=None, port=args.port, gpu_kv_blocks=40,
                                        stream_interval_ms=5.0)
        url = bench.start(bench_args)
    else:
        url = args.url

    res, wall = asyncio.run(closed_loop(url, "medium-qwen3", args.concurrency, args.duration,
                                        Workload(args.prompt_tokens, args.output_tokens)))
    ours = summarize(res, wall, 2.0, 0.15)
    print("ours:", json.dumps(ours), flush=True)

    gl_json = out / "guidellm.json"
    cmd = [args.guidellm, "benchmark", "--target", url, "--model", "medium-qwen3", "--processor", str(model_dir),
           "--data", f"prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--rate-type", "concurrent", "--rate", str(args.concurrency), "--max-seconds", str(args.duration),
           "--output-path", str(gl_json)]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration * 6 + 120,
                       env={**os.environ, "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"})
    (out / "guidellm.log").write_text(r.stdout[-20000:] + r.stderr[-20000:])
    result = {"workload": vars(args), "ours": ours, "guidellm_rc": r.returncode, "guidellm_s": round(time.time() - t, 1)}
    if r.returncode == 0 and gl_json.exists():
        result["guidellm"] = guidellm_figures(gl_json)
    else:
        result["guidellm_error"] = (r.stderr or r.stdout)[-2000:]
    (out / "compare.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str), flush=True)
    if not args.url:
        from ray import serve
        import ray

        serve.shutdown()
        ray.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
