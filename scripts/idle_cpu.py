#!/usr/bin/env python3
"""What an idle server costs: starts the same graph as scripts/bench.py (emulated GPU pools on
CPU 0, CPU pool on CPU 1), sends nothing, and prints the cores each process used over a window.
On a 2-core box every idle hundredth of a core is taken from the engines under load.

    python scripts/idle_cpu.py --seconds 20
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402


def per_process() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter(["pid", "cmdline", "cpu_times", "name"]):
        try:
            name = " ".join(p.info["cmdline"] or []) or p.info["name"]
            t = p.info["cpu_times"]
            out[p.info["pid"]] = (name[:90], t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured idle window")
    ap.add_argument("--settle", type=float, default=8.0, help="seconds to wait after the app is ready")
    ap.add_argument("--port", type=int, default=8021)
    args = ap.parse_args()
    bench.start(bench.parser().parse_args(["--port", str(args.port)]))  # the bench's graph, its defaults
    time.sleep(args.settle)
    a = per_process()
    time.sleep(args.seconds)
    b = per_process()
    rows = sorted(((t - a[pid][1]) / args.seconds, pid, name) for pid, (name, t) in b.items() if pid in a)
    rows = [r for r in rows if r[0] >= 0.002][::-1]
    for cores, pid, name in rows:
        print(f"{cores:6.3f}  {pid:>7}  {name}")
    print(f"{sum(r[0] for r in rows):6.3f}  total cores, idle, over {args.seconds:.0f} s", flush=True)
    from ray import serve
    import ray

    serve.shutdown()
    ray.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
