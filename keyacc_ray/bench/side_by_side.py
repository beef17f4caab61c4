"""Offload policies against GPU-only on the same workload, in one run, and the two derived
figures (issue #6):

- concurrency gain: the highest concurrency whose p99 TTFT and p99 TPOT meet the objective (no
  failed request), as a ratio to gpu_only's;
- harvest efficiency: (throughput with the policy - throughput gpu_only) / throughput of the
  CPU pool alone, each at saturation: the peak over the concurrency levels (gpu_only's
  throughput sags past its peak as queues grow; its peak is the fair, conservative figure).
  1.0: every token the CPU pool can make is added to the GPU pool's.

The CPU pool alone is measured on the same server with every request pinned to it
(`keyacc.route: cpu`). Policies are switched by a callable (in the harness: a Serve
`reconfigure` of the Router, no restart). Plain asyncio + HTTP; no Ray here.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Callable

from keyacc_ray.bench.loadgen import Workload, closed_loop, summarize
from keyacc_ray.bench.timeline import sample_metrics

POLICIES = ["gpu_only", "full_offload", "stage_offload", "auto"]


@dataclass
class Plan:
    levels: list[int] = field(default_factory=lambda: [2, 6, 12, 20])
    duration_s: float = 15.0  # the measured steady state of each run, after its ramp
    ramp_s: float = 4.0  # each run starts this long before its measured window (all clients send at once)
    warmup_s: float = 3.0
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 150.0
    timeline_policy: str = "auto"  # the run whose timeline is recorded (at the top level); "none": none
    cpu_alone: bool = True
    # "policy": each policy through every level, one after another (the CPU pool alone last);
    # "level": every policy at each level before the next level, the order rotated level by level
    # and the CPU pool alone right after the top level's. On a machine whose speed drifts over
    # minutes, "level" keeps the cells a figure compares (harvest: a policy's top level against
    # gpu_only's and the CPU pool alone) minutes closer: policy-major puts ~8 minutes of a 14-minute
    # run between gpu_only's top level and the CPU pool alone
    order: str = "policy"
    # Low load, policy against gpu_only: short runs at the lowest level, policies interleaved
    # round by round and medians taken, so a drift of the machine does not land on one policy.
    low_load_rounds: int = 3
    low_load_s: float = 6.0


def cells(plan: Plan) -> list[tuple[str, int]]:
    """The measured runs (policy, clients) in the order `plan.order` says."""
    if plan.order == "policy":
        return [(p, c) for p in plan.policies for c in plan.levels]
    if plan.order != "level":
        raise ValueError(f"order must be 'policy' or 'level', got {plan.order!r}")
    n = len(plan.policies)
    return [(p, c) for i, c in enumerate(plan.levels) for p in plan.policies[i % n:] + plan.policies[:i % n]]


def window(plan: Plan) -> tuple[float, float] | None:
    """The measured steady state of a run: after its ramp, until its clients stop sending."""
    return (plan.ramp_s, plan.ramp_s + plan.duration_s) if plan.ramp_s > 0 else None


def within_slo(runs: dict, plan: Plan) -> int:
    ok = [c for c, s in runs.items() if s["failed"] == 0 and s["ttft_p99_ms"] <= plan.ttft_slo_ms
          and s["tpot_p99_ms"] <= plan.tpot_slo_ms]
    return max(ok) if ok else 0


def derive(runs: dict, cpu_alone: dict | None, plan: Plan) -> dict:
    """The report's figures from per-policy, per-level summaries (pure arithmetic; tested)."""
    low = min(plan.levels)
    base = runs.get("gpu_only")
    out: dict = {"concurrency_within_slo": {p: within_slo(r, plan) for p, r in runs.items()},
                 "concurrency_gain": {}, "throughput_gain": {}, "harvest_efficiency": {}, "low_load": {}}
    if not base:
        return out
    def peak(r):
        return max(s["output_tok_per_s"] for s in r.values())

    base_c, base_t = out["concurrency_within_slo"]["gpu_only"], peak(base)
    cpu_t = cpu_alone["output_tok_per_s"] if cpu_alone else None
    out["peak_output_tok_per_s"] = {p: peak(r) for p, r in runs.items()}
    for p, r in runs.items():
        out["concurrency_gain"][p] = round(out["concurrency_within_slo"][p] / base_c, 3) if base_c else None
        out["throughput_gain"][p] = round(peak(r) / base_t, 3) if base_t else None
        out["harvest_efficiency"][p] = round((peak(r) - base_t) / cpu_t, 3) if cpu_t else None
        out.setdefault("harvest_model", {})[p] = harvest_model(r, base_t, cpu_alone) if p != "gpu_only" else None
        b, s = base[low], r[low]
        out["low_load"][p] = {
            "ttft_p50_ratio": round(s["ttft_p50_ms"] / b["ttft_p50_ms"], 3) if b["ttft_p50_ms"] else None,
            "tpot_p50_ratio": round(s["tpot_p50_ms"] / b["tpot_p50_ms"], 3) if b["tpot_p50_ms"] else None}
    return out


def harvest_model(runs: dict, gpu_only_tok_s: float, cpu_alone: dict | None) -> float | None:
    """The harvest a simple model predicts when both engines and the serving stack share the
    box's cores while each stand-alone baseline had an idle core for its stack (this 2-core box):
    with s the stack's CPU per token in this policy's peak run, T_g gpu_only's peak and e_c the
    CPU engine's CPU per token alone, the GPU pool at T_g leaves the CPU pool
    (1 - s*T_g) / (e_c + s) tokens/s, i.e. harvest ~ (1 - s*T_g) / (1 + s/e_c). It has landed
    within 0.1 of the measured harvest in every run here. None without CPU figures (`cores_used`)."""
    top = max(runs.values(), key=lambda r: r["output_tok_per_s"])
    s_ms = top.get("stack_ms_per_token")
    cores = (cpu_alone or {}).get("cores_used") or {}
    if not s_ms or not cores.get("cpu_decode") or not cpu_alone.get("output_tok_per_s"):
        return None
    s, e_c = s_ms / 1e3, cores["cpu_decode"] / cpu_alone["output_tok_per_s"]
    return round(max(0.0, 1 - s * gpu_only_tok_s) / (1 + s / e_c), 3)


def low_load_ratios(samples: dict[str, list[dict]], pooled: dict[str, dict] | None = None) -> dict:
    """Per policy: p50 TTFT and TPOT as ratios to gpu_only's. With `pooled` (a summary of every
    round's requests together) its p50s; else the median of the rounds' p50s."""
    def med(xs):
        xs = sorted(xs)
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    m = {p: {k: med([s[k] for s in ss]) for k in ("ttft_p50_ms", "tpot_p50_ms")} for p, ss in samples.items() if ss}
    if pooled:
        m = {p: {k: pooled[p][k] for k in ("ttft_p50_ms", "tpot_p50_ms")} for p in m if p in pooled}
    base = m.get("gpu_only")
    if not base:
        return {}
    out = {}
    for p, v in m.items():
        shares = [s.get("token_share", {}).get("gpu", 0.0) for s in samples[p]]
        out[p] = {"ttft_p50_ratio": round(v["ttft_p50_ms"] / base["ttft_p50_ms"], 3),
                  "tpot_p50_ratio": round(v["tpot_p50_ms"] / base["tpot_p50_ms"], 3),
                  "ttft_p50_ms": round(v["ttft_p50_ms"], 1), "tpot_p50_ms": round(v["tpot_p50_ms"], 2),
                  "rounds_ttft_p50_ms": [s["ttft_p50_ms"] for s in samples[p]],
                  "rounds_tpot_p50_ms": [s["tpot_p50_ms"] for s in samples[p]],
                  # the path taken: at low load every policy should leave everything on the GPU
                  "gpu_token_share": round(min(shares), 3) if shares else None,
                  "moves": sum(s.get("moves", 0) for s in samples[p])}
    return out


def run(url: str, model: str, wl: Workload, plan: Plan, set_policy: Callable[[str], None],
        policy_options: dict | None = None, log: Callable[[str], None] = print,
        cpu_probe: Callable[[], dict] | None = None, checkpoint: Callable[[dict], None] | None = None,
        keep: Callable[[str, list], None] | None = None) -> dict:
    """`cpu_probe`, when given, returns cumulative CPU seconds per server component; each run then
    records the cores each component used (`cores_used`). `checkpoint`, when given, gets the
    report so far (marked `"partial": true`) after each run, so a run cut short still leaves figures.
    `keep`, when given, gets each measured run's name ("policy/clients", "cpu-alone") and its
    requests (loadgen.Result: token times, the server's trace)."""
    runs: dict = {}
    timeline = None
    cpu_alone = None

    def save() -> None:
        if checkpoint:
            checkpoint({"partial": True, "plan": asdict(plan), "workload": asdict(wl),
                        "policy_options": policy_options or {}, "runs": runs, "cpu_alone": cpu_alone})
    current = None
    for pol, c in cells(plan):
        if pol != current:
            set_policy(pol)
            asyncio.run(closed_loop(url, model, 2, plan.warmup_s, wl, desc=f"{pol} warm-up", stream=f"warm-up/{pol}"))
            current = pol
        record = pol == plan.timeline_policy and c == max(plan.levels)
        before = cpu_probe() if cpu_probe else None
        res, wall, tl = asyncio.run(_measure(url, model, c, plan.ramp_s + plan.duration_s, wl, record, pol))
        s = summarize(res, wall, plan.ttft_slo_ms / 1e3, plan.tpot_slo_ms / 1e3, window(plan))
        if keep:
            keep(f"{pol}/{c}", res)
        if cpu_probe:
            s.update(_cpu_figures(before, cpu_probe(), res, wall))
        runs.setdefault(pol, {})[c] = s
        if tl is not None:
            timeline = {"policy": pol, "concurrency": c, **tl}
        log(f"{pol:<14} c={c:<3} tok/s={s['output_tok_per_s']:<7} req/s={s['req_per_s']:<6} "
            f"ttft p50/p99={s['ttft_p50_ms']}/{s['ttft_p99_ms']} tpot p50/p99={s['tpot_p50_ms']}/"
            f"{s['tpot_p99_ms']} share={s['token_share']} moves={s['moves']} failed={s['failed']}")
        save()
    if plan.cpu_alone:
        set_policy("gpu_only")
        c = max(plan.levels)
        before = cpu_probe() if cpu_probe else None
        res, wall = asyncio.run(closed_loop(url, model, c, plan.ramp_s + plan.duration_s, wl,
                                            extra={"keyacc": {"route": "cpu"}}, desc="cpu pool alone",
                                            stream="cpu-alone"))
        cpu_alone = summarize(res, wall, plan.ttft_slo_ms / 1e3, plan.tpot_slo_ms / 1e3, window(plan))
        if keep:
            keep("cpu-alone", res)
        if cpu_probe:
            cpu_alone.update(_cpu_figures(before, cpu_probe(), res, wall))
        log(f"{'cpu alone':<14} c={c:<3} tok/s={cpu_alone['output_tok_per_s']} failed={cpu_alone['failed']}")
        save()
    samples: dict[str, list[dict]] = {p: [] for p in plan.policies}
    raw: dict[str, list] = {p: [] for p in plan.policies}
    walls: dict[str, float] = {p: 0.0 for p in plan.policies}
    n = len(plan.policies)
    for r in range(plan.low_load_rounds):
        # each round starts with another policy: none always runs right after a given other one
        for pol in plan.policies[r % n:] + plan.policies[:r % n]:
            set_policy(pol)
            c = min(plan.levels)
            res, wall = asyncio.run(closed_loop(url, model, c, plan.low_load_s, wl, desc=f"low load {pol} #{r}",
                                                stream=f"low-load/{pol}/{r}"))
            samples[pol].append(summarize(res, wall, plan.ttft_slo_ms / 1e3, plan.tpot_slo_ms / 1e3))
            raw[pol] += res
            walls[pol] += wall
    pooled = {p: summarize(raw[p], walls[p], plan.ttft_slo_ms / 1e3, plan.tpot_slo_ms / 1e3)
              for p in plan.policies if raw[p]}
    report = {"plan": asdict(plan), "workload": asdict(wl), "policy_options": policy_options or {},
              "runs": runs, "cpu_alone": cpu_alone, "timeline": timeline}
    report.update(derive(runs, cpu_alone, plan))
    if plan.low_load_rounds:
        report["low_load"] = low_load_ratios(samples, pooled)
        log("low load (p50 over %d interleaved rounds): %s" % (plan.low_load_rounds, report["low_load"]))
    return report


def _cpu_figures(before: dict, after: dict, results, wall_s: float) -> dict:
    """Cores each server component used over a whole run, and the serving stack's CPU per token
    (tokens over the same whole run: the interval the CPU was measured over)."""
    from keyacc_ray.bench.cpu_account import delta, stack_ms_per_token

    every = delta(before, after, wall_s)
    cores = {k: v for k, v in every.items() if "/" not in k}
    rate = sum(r.output_tokens for r in results if r.ok) / max(wall_s, 1e-6)
    return {"cores_used": cores, "stack_ms_per_token": stack_ms_per_token(cores, rate),
            # the engine threads alone (their steps): what the simulator's stack model is fitted on
            "engine_thread_cores": {k.split("/")[0]: v for k, v in every.items() if k.endswith("/engine")}}


async def _measure(url, model, c, duration_s, wl, record: bool, pol: str):
    if not record:
        res, wall = await closed_loop(url, model, c, duration_s, wl, desc=f"{pol} c={c}", stream=f"{pol}/{c}")
        return res, wall, None
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_metrics(url, stop, 0.5))
    res, wall = await closed_loop(url, model, c, duration_s, wl, desc=f"{pol} c={c}", stream=f"{pol}/{c}")
    stop.set()
    return res, wall, await sampler
