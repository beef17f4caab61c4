#!/usr/bin/env python3
"""How often the emulated GPU decode pool preempts (lazy KV) under the bench's graph and workload,
and how many of those decodes move to the CPU pool: 40 clients, 20 s per policy, counters read
from /metrics before and after.

    python scripts/preempt_probe.py
"""
import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

from keyacc_ray.bench.loadgen import Workload, closed_loop  # noqa: E402

args = bench.parser().parse_args(["--port", "8031"])
url = bench.start(args)
options = {"trigger_window_s": 0.3, "return_window_s": 1.0, "decode_period_tokens": 32}
set_policy = bench.policy_switcher(options)

def counters():
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("keyacc_preemptions_total") and "GpuDecode" in line:
            out["gpu_preemptions"] = out.get("gpu_preemptions", 0) + float(line.rsplit(" ", 1)[1])
        if line.startswith("keyacc_gpu_preemptions_moved_total"):
            out["moved"] = float(line.rsplit(" ", 1)[1])
    return out

wl = Workload(prompt_tokens=64, output_tokens=96)
for pol in ("gpu_only", "full_offload", "auto"):
    set_policy(pol)
    before = counters()
    res, wall = asyncio.run(closed_loop(url, bench.MODEL_NAME, 40, 20.0, wl))
    time.sleep(2)
    after = counters()
    print(pol, "requests", len(res), "tok/s", round(sum(r.output_tokens for r in res if r.ok) / wall, 1),
          {k: after.get(k, 0) - before.get(k, 0) for k in after}, flush=True)
