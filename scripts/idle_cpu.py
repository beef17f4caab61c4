#!/usr/bin/env python3
"""What an idle server costs: starts the same graph as scripts/bench.py (emulated GPU pools on
CPU 0, CPU pool on CPU 1), sends nothing, and prints the cores each process used over a window.
On a 2-core box every idle hundredth of a core is taken from the engines under load.

    python scripts/idle_cpu.py --seconds 20
    python scripts/idle_cpu.py --set RAY_SERVE_CONTROL_LOOP_INTERVAL_S=2   # one setting's effect
    python scripts/idle_cpu.py --ray-floor   # what one idle Ray actor costs, nothing of ours in it

`--set K=V` (repeatable) puts a variable in the environment Ray is started with (Ray's own
`RAY_<config>` settings, Serve's `RAY_SERVE_*`, the dashboard agent's `REPORTER_UPDATE_INTERVAL_MS`),
so each setting's effect is measured on the same graph. `--ray-floor` starts Ray alone with one
idle actor and prints its cores and, per thread, its wake-ups per second: the floor every Ray
worker process pays (its main thread wakes every 10 ms to check for signals), which is what most
of an idle server's CPU is made of.
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


def thread_wakeups(pid: int) -> dict[str, tuple[str, int, float]]:
    """Per thread of `pid`: (name, voluntary context switches, CPU seconds)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            base = f"/proc/{pid}/task/{tid}"
            name = open(f"{base}/comm").read().strip()
            switches = next(int(line.split()[1]) for line in open(f"{base}/status") if line.startswith("voluntary"))
            fields = open(f"{base}/stat").read().rsplit(")", 1)[1].split()
            out[tid] = (name, switches, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        except (OSError, StopIteration, ValueError):
            continue
    return out


def ray_floor(seconds: float) -> None:
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Idle:
        def pid(self) -> int:
            return os.getpid()

    actor = Idle.remote()
    pid = ray.get(actor.pid.remote(), timeout=60)
    time.sleep(2.0)
    proc = psutil.Process(pid)
    c0, a = sum(proc.cpu_times()[:2]), thread_wakeups(pid)
    time.sleep(seconds)
    c1, b = sum(proc.cpu_times()[:2]), thread_wakeups(pid)
    rows = sorted(((s - a[t][1]) / seconds, (c - a[t][2]) / seconds, n) for t, (n, s, c) in b.items() if t in a)
    for wakes, cores, name in rows[::-1]:
        if wakes >= 0.5:
            print(f"{wakes:7.1f} wake-ups/s  {cores:6.4f} cores  thread {name}")
    print(f"{(c1 - c0) / seconds:6.4f}  cores of one idle Ray actor process over {seconds:.0f} s", flush=True)
    ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured idle window")
    ap.add_argument("--settle", type=float, default=8.0, help="seconds to wait after the app is ready")
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="environment of the Ray cluster")
    ap.add_argument("--ray-floor", action="store_true", help="one idle Ray actor instead of the graph")
    args = ap.parse_args()
    for kv in args.set:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            ap.error(f"--set wants K=V, got {kv!r}")
        os.environ[k] = v  # before Ray starts: its processes inherit it (an operator's value wins in apply_cluster_env)
    if args.ray_floor:
        ray_floor(args.seconds)
        return
    bench.start(bench.parser().parse_args(["--port", str(args.port)]))  # the bench's graph, its defaults
    time.sleep(args.settle)
    a = per_process()
    time.sleep(args.seconds)
    b = per_process()
    rows = sorted(((t - a[pid][1]) / args.seconds, pid, name) for pid, (name, t) in b.items() if pid in a)
    rows = [r for r in rows if r[0] >= 0.002][::-1]
    for cores, pid, name in rows:
        print(f"{cores:6.3f}  {pid:>7}  {name}")
    settings = " ".join(args.set) or "defaults"
    print(f"{sum(r[0] for r in rows):6.3f}  total cores, idle, over {args.seconds:.0f} s ({settings})", flush=True)
    from ray import serve
    import ray

    serve.shutdown()
    ray.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
