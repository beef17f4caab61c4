#!/usr/bin/env python3
"""Serve-level figures for docs/benchmarks.md: time from `serve run` to the first served token,
p50 latency of a 1-token completion, Serve overhead per generated token (HTTP through ingress ->
router -> pools, against the engine's own decode step in-process), and the app's memory at idle.

    python scripts/bench_serve.py --launch            # starts `serve run deployments/app.yaml` itself
    python scripts/bench_serve.py --url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def post(c: httpx.Client, body: dict) -> dict:
    r = c.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()


def wait_first_token(url: str, model: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}, timeout=30)
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError("no token served")


def ray_rss_bytes() -> int:
    import psutil

    total = 0
    for p in psutil.process_iter(["name", "cmdline", "memory_info"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ray" in (p.info["name"] or "") or "/ray/" in cmd or "ray::" in cmd:
            total += p.info["memory_info"].rss if p.info["memory_info"] else 0
    return total


def engine_ms_per_token(model: str, n: int, route_threads: int = 1) -> float:
    import torch

    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    torch.set_num_threads(route_threads)
    eng = LLMEngine(EngineConfig(model=model, max_num_seqs=2, max_model_len=512))
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    eng.generate(["Hello, world!"], p)
    eng.add_request("x", "Hello, world!", p)
    eng.step()
    t = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--launch", action="store_true", help="start `serve run deployments/app.yaml` and stop it after")
    ap.add_argument("--model-name", default="tiny-qwen3")
    ap.add_argument("--model-path", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--n", type=int, default=64, help="tokens for the per-token overhead")
    args = ap.parse_args()
    res: dict = {}
    proc = None
    if args.launch:
        try:
            httpx.get(f"{args.url}/health", timeout=2)
            sys.exit(f"something already serves {args.url}; stop it or drop --launch")
        except httpx.HTTPError:
            pass
        t0 = time.monotonic()
        proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", "deployments/app.yaml"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_first_token(args.url, args.model_name, 300)
        res["serve_run_to_first_token_s"] = round(time.monotonic() - t0, 1)
    try:
        c = httpx.Client(base_url=args.url, timeout=120)
        time.sleep(3)
        res["idle_rss_all_ray_processes_mib"] = round(ray_rss_bytes() / 2**20)
        lat = []
        for _ in range(40):
            t = time.perf_counter()
            post(c, {"model": args.model_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
            lat.append((time.perf_counter() - t) * 1e3)
        res["p50_ms_1_token_completion"] = round(statistics.median(lat), 1)
        for route in ("gpu", "cpu"):
            per = []
            for _ in range(5):
                body = {"model": args.model_name, "prompt": "Hello, world!", "temperature": 0, "ignore_eos": True,
                        "keyacc": {"route": route}}
                t = time.perf_counter()
                post(c, {**body, "max_tokens": 2})
                t2 = time.perf_counter() - t
                t = time.perf_counter()
                post(c, {**body, "max_tokens": args.n})
                tn = time.perf_counter() - t
                per.append((tn - t2) / (args.n - 2) * 1e3)
            res[f"http_ms_per_token_{route}"] = round(statistics.median(per), 3)
        eng = engine_ms_per_token(args.model_path, args.n)
        res["engine_ms_per_token_inproc"] = round(eng, 3)
        res["serve_overhead_ms_per_token"] = round(res["http_ms_per_token_gpu"] - eng, 3)
    finally:
        if proc is not None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):  # our own session only
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(30)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
    for k, v in res.items():
        print(f"{k:<36} {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
