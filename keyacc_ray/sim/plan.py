"""Planning on a scenario (keyacc_ray/sim/hardware.py): per policy, the most closed-loop clients
the server holds within a TTFT and TPOT objective (p99 of the requests started in the measured
window), the output tokens/s there, and the gains against gpu_only, as the bench reports them
(scripts/bench.py: concurrency gain, throughput gain), but found by search instead of at fixed
levels: the client count doubles until the objective fails, then bisects."""
from __future__ import annotations

import random
import time

from keyacc_ray.policies import make_policy
from keyacc_ray.sim.report import summarize
from keyacc_ray.sim.server import ServerSpec, SimServer
from keyacc_ray.sim.workload import SimRequest

POLICY_OPTIONS = {"trigger_window_s": 1.0, "return_window_s": 5.0, "decode_period_tokens": 64}


def closed_run(spec: ServerSpec, policy: str, clients: int, workload, ramp_s: float, measure_s: float,
               seed: int = 0, options: dict | None = None) -> dict:
    """`clients` clients send back to back for ramp_s + measure_s (starting one after another
    over the first half of the ramp: a load that builds up, not one burst); the figures of the requests
    of the measured window (the first ramp_s left out): those that arrived in it, and those that
    arrived before it and were still waiting for their first token when it began (a request
    stuck in a queue through the whole window counts against the objective)."""
    rng = random.Random(seed * 7919 + clients)

    def make(i: int) -> SimRequest:
        o = rng.randint(*workload.output_tokens)
        return SimRequest(f"r{i}", rng.randint(*workload.prompt_tokens), o, max(o, workload.max_tokens))
    srv = SimServer(spec, policy, {} if policy == "gpu_only" else (options or POLICY_OPTIONS))
    done = srv.run_closed(clients, ramp_s + measure_s, make, stagger_s=ramp_s / 2)
    window = [lv for lv in done if lv.req.arrival >= ramp_s or lv.first_t is None or lv.first_t >= ramp_s]
    s = summarize(window)
    end = ramp_s + measure_s  # tokens made inside the window, by every request
    tokens = sum(sum(1 for t in lv.token_times if ramp_s <= lv.req.arrival + t < end) for lv in done)
    s["window_output_tokens_per_s"] = round(tokens / measure_s, 1)
    s["clients"] = clients
    return s


def meets(s: dict, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    return (s.get("failed", 1) == 0 and s.get("ttft_p99_s") is not None and s["ttft_p99_s"] <= ttft_slo_s
            and (s.get("tpot_p99_s") or 0.0) <= tpot_slo_s)


def max_clients(spec: ServerSpec, policy: str, workload, ttft_slo_s: float, tpot_slo_s: float, ramp_s: float,
                measure_s: float, start: int = 8, limit: int = 4096, log=None,
                options: dict | None = None) -> tuple[int, dict | None, list]:
    """The most clients within the objective (0 if not even one), its run, and every run tried."""
    tried: dict[int, dict] = {}

    def ok(c: int) -> bool:
        if c not in tried:
            t0 = time.time()
            tried[c] = closed_run(spec, policy, c, workload, ramp_s, measure_s, options=options)
            if log:
                s = tried[c]
                log(f"  {policy:<14} c={c:<5} tok/s={s['window_output_tokens_per_s']:<9} "
                    f"ttft p99={s.get('ttft_p99_s') and round(s['ttft_p99_s'], 3)} "
                    f"tpot p99={s.get('tpot_p99_s') and round(s['tpot_p99_s'], 4)} "
                    f"cpu share={s.get('cpu_token_share')} ({time.time() - t0:.1f} s)")
        return meets(tried[c], ttft_slo_s, tpot_slo_s)

    lo, hi = 0, start
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    if lo == 0:  # below the start: search 1 .. start
        hi = min(hi, start)
        if not ok(1):
            return 0, None, sorted(tried.items())
        lo = 1
    while hi - lo > max(1, lo // 16):  # to within about 6%
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, tried[lo], sorted(tried.items())


def plan(scenario, policies: list[str], ramp_s: float = 30.0, measure_s: float = 90.0, log=None,
         options: dict | None = None) -> dict:
    """The scenario's table: per policy its most clients within the objective, the output
    tokens/s there, the CPU pool's share of the tokens; gains against gpu_only. `options`: the
    offload policies' options over POLICY_OPTIONS (each policy takes the ones it knows)."""
    merged = {**POLICY_OPTIONS, **(options or {})}
    spec = scenario.spec()
    rows = {}
    for p in policies:
        if p != "gpu_only" and scenario.cpu_slots() == 0:  # not one CPU decode row within the TPOT objective
            rows[p] = {"clients_within_slo": None, "output_tok_per_s": None, "ttft_p99_s": None, "tpot_p99_s": None,
                       "cpu_token_share": None, "note": "the CPU pool cannot step one row within the TPOT objective"}
            continue
        known = set(make_policy(p, {}).options)  # a policy refuses options it does not take
        c, s, _ = max_clients(spec, p, scenario.workload, scenario.ttft_slo_s, scenario.tpot_slo_s, ramp_s,
                              measure_s, log=log, options={k: v for k, v in merged.items() if k in known})
        rows[p] = {"clients_within_slo": c, "output_tok_per_s": s["window_output_tokens_per_s"] if s else 0.0,
                   "ttft_p99_s": s and round(s["ttft_p99_s"], 3), "tpot_p99_s": s and round(s["tpot_p99_s"] or 0, 4),
                   "cpu_token_share": s and s["cpu_token_share"]}
    base = rows.get("gpu_only")
    for p, r in rows.items():
        r["concurrency_gain"] = round(r["clients_within_slo"] / base["clients_within_slo"], 3) \
            if base and base["clients_within_slo"] and r["clients_within_slo"] is not None else None
        r["throughput_gain"] = round(r["output_tok_per_s"] / base["output_tok_per_s"], 3) \
            if base and base["output_tok_per_s"] and r["output_tok_per_s"] is not None else None
    return {**scenario.describe(), "policies": rows}
