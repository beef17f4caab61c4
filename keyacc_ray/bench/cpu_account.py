"""Where the box's CPU went during a run: CPU seconds of this host's Ray Serve processes by
component (engine pools, router, ingress, proxy, controller, the rest of Ray) and of the load
generator itself; on request, of the engine replicas' engine threads alone (`<component>/engine`:
the steps, apart from the rest of the replica's threads). Only meaningful when the server runs on
the same host as the benchmark."""
from __future__ import annotations

import os

import psutil

from keyacc_ray.hw.pinning import ENGINE_THREAD_NAME

COMPONENTS = [("GpuPrefill", "gpu_prefill"), ("GpuDecode", "gpu_decode"), ("CpuDecode", "cpu_decode"),
              ("Router", "router"), ("Ingress", "ingress"), ("ProxyActor", "proxy"),
              ("ServeController", "controller"), ("LoadMonitor", "monitor"), ("haproxy", "haproxy")]


def _component(cmdline: str) -> str | None:
    for key, name in COMPONENTS:
        if key in cmdline:
            return name
    if "ray::" in cmdline or "raylet" in cmdline or "gcs_server" in cmdline or "/ray/" in cmdline:
        return "ray_other"
    return None


def snapshot(engine_threads: bool = False) -> dict[str, float]:
    """Cumulative CPU seconds per component now (processes that exited are not counted); with
    `engine_threads`, also `<engine component>/engine`: its engine threads' alone."""
    out: dict[str, float] = {}
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        try:
            if p.info["pid"] == me:
                name = "load_generator"
            else:
                name = _component(" ".join(p.info["cmdline"] or []) or p.name())
            if name is None:
                continue
            t = p.info["cpu_times"]
            out[name] = out.get(name, 0.0) + t.user + t.system
            if engine_threads and name in ENGINES:
                key = f"{name}/engine"
                out[key] = out.get(key, 0.0) + engine_thread_cpu_s(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return out


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def engine_thread_cpu_s(pid: int) -> float:
    """CPU seconds of a process's threads named ENGINE_THREAD_NAME (Linux /proc; 0 elsewhere)."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if comm == ENGINE_THREAD_NAME:
            total += (int(rest[11]) + int(rest[12])) / _TICK  # utime, stime (fields 14, 15)
    return total


def delta(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Cores used per component over the interval (CPU seconds / wall seconds); `<engine>/engine`
    keys for the engine threads within."""
    return {k: round(max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) / max(wall_s, 1e-6), 3)
            for k in sorted(set(before) | set(after))}


ENGINES = ("gpu_prefill", "gpu_decode", "cpu_decode")


def stack_ms_per_token(cores_used: dict[str, float], tokens_per_s: float) -> float | None:
    """CPU milliseconds per generated token spent outside the engine replicas: ingress, router,
    proxy, controller, monitor, the rest of Ray and the load generator (the serving stack's
    cost per streamed token; the engine replicas' own streaming is in theirs)."""
    if tokens_per_s <= 0:
        return None
    stack = sum(v for k, v in cores_used.items() if k not in ENGINES and "/" not in k)
    return round(1e3 * stack / tokens_per_s, 2)


def own_cpu_s() -> float:
    """CPU seconds of this process so far (user + system, every thread)."""
    t = os.times()
    return t.user + t.system

