"""The benchmark harness against the real app over HTTP: closed and open loop, the CLI's JSON,
and a short side-by-side run (policies switched in place) whose report has every figure."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from keyacc_ray.bench import side_by_side
from keyacc_ray.bench.loadgen import Workload, closed_loop, open_loop, summarize
from keyacc_ray.bench.plots import plot_report
from tests.conftest import ROOT
from tests.e2e.test_offload import FAST, MODEL, policy, set_policy  # noqa: F401 - fixture

KEYS = {"requests", "failed", "req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
        "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
        "goodput_req_per_s", "token_share", "moves", "errors"}
WL = Workload(prompt_tokens=12, output_tokens=8, prompt_spread=0.5)


def test_closed_and_open_loop(app_url):
    res, wall = asyncio.run(closed_loop(app_url, MODEL, 3, 2.0, WL))
    s = summarize(res, wall, 5.0, 1.0)
    assert KEYS <= set(s) and s["requests"] >= 3 and s["failed"] == 0, s
    assert s["output_tok_per_s"] > 0 and s["ttft_p50_ms"] > 0 and s["tpot_p50_ms"] > 0
    assert sum(s["token_share"].values()) > 0.99
    res, wall = asyncio.run(open_loop(app_url, MODEL, 4.0, 2.0, WL))
    s = summarize(res, wall, 5.0, 1.0)
    assert s["failed"] == 0 and s["requests"] == len(res) > 0


def test_cli_json(app_url, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "keyacc_ray.bench", "--url", app_url, "--model", MODEL, "--rate", "3",
                        "--duration", "2", "--prompt-tokens", "8", "--output-tokens", "6", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert KEYS <= set(last) and last["failed"] == 0 and last["mode"] == {"rate_per_s": 3.0}
    saved = json.loads(out.read_text())
    assert len(saved["requests"]) == last["requests"] and "api_key" not in saved["args"]


def test_side_by_side_report(app_url, policy, tmp_path):  # noqa: F811
    plan = side_by_side.Plan(levels=[1, 3], duration_s=1.5, ramp_s=0.5, warmup_s=0.5, low_load_rounds=1, low_load_s=1.0,
                             policies=["gpu_only", "full_offload", "auto"], timeline_policy="full_offload",
                             order="level")
    from keyacc_ray.bench import cpu_account

    kept, switched = {}, []

    def switch(name: str) -> None:
        switched.append(name)
        policy(name, {} if name == "gpu_only" else FAST)
    report = side_by_side.run(app_url, MODEL, Workload(prompt_tokens=12, output_tokens=24), plan,
                              switch, FAST, log=lambda m: None,
                              cpu_probe=lambda: cpu_account.snapshot(engine_threads=True),
                              keep=lambda name, res: kept.setdefault(name, res))
    # level by level, rotated; then the CPU pool alone (under gpu_only), then one low-load round
    assert switched == ["gpu_only", "full_offload", "auto", "full_offload", "auto", "gpu_only", "gpu_only",
                        "gpu_only", "full_offload", "auto"], switched
    # every measured run's requests, as measured (bench.py --requests): their token times and traces
    assert set(kept) == {f"{p}/{c}" for p in plan.policies for c in plan.levels} | {"cpu-alone"}
    assert all(r.ok and 1 <= len(r.token_times) <= r.output_tokens == 24 and r.segments for r in kept["cpu-alone"])
    assert report["runs"]["auto"][3]["requests"] <= len(kept["auto/3"])
    for key in ("harvest_efficiency", "concurrency_gain", "throughput_gain", "low_load"):
        assert set(report[key]) == {"gpu_only", "full_offload", "auto"}, key
    assert report["harvest_efficiency"]["gpu_only"] == 0.0 and report["throughput_gain"]["gpu_only"] == 1.0
    assert all(isinstance(v, float) for v in report["harvest_efficiency"].values())
    assert report["cpu_alone"]["token_share"] == {"cpu": 1.0}  # pinned: every token on the CPU pool
    assert report["runs"]["gpu_only"][3]["token_share"] == {"gpu": 1.0}
    # where the CPU went: this host's Serve processes by component, and the stack's cost per token
    used = report["cpu_alone"]["cores_used"]
    assert {"cpu_decode", "ingress", "router", "proxy", "load_generator"} <= set(used)
    assert used["cpu_decode"] > used["gpu_decode"]  # pinned to the CPU pool: its engine did the work
    assert 0 < report["cpu_alone"]["stack_ms_per_token"] < 1000
    # the engine thread within the replica, told apart by its OS name (the simulator's stack fit)
    engine = report["cpu_alone"]["engine_thread_cores"]
    assert 0 < engine["cpu_decode"] <= used["cpu_decode"] and engine["gpu_decode"] < engine["cpu_decode"]
    tl = report["timeline"]
    assert tl["policy"] == "full_offload" and len(tl["t"]) >= 1 and tl["tokens_per_s"]
    files = plot_report(report, tmp_path)
    assert len(files) == 4
    json.dumps(report)  # the report is plain JSON
