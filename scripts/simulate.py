#!/usr/bin/env python3
"""The serving graph in the simulator (keyacc_ray/sim): the real router and policies on simulated
time over engines timed by a calibrated step-time profile.

Side by side, as scripts/bench.py measures it (policies x closed-loop levels, the same windows
and figures: keyacc_ray/bench/loadgen.summarize and side_by_side.derive), on this box's graph:

    python scripts/simulate.py --profile this-box-medium-cpu --levels 2 8 24 40 --duration 10

Against a real run (scripts/bench.py's report.json; the same plan, workload and options are
simulated) with the errors of the simulation as the last line's JSON (throughput_mape,
ttft_p50_mape, tpot_p50_mape, harvest_abs_err, ranking_agrees):

    python scripts/simulate.py --validate results/bench-XXXX/report.json
    python scripts/simulate.py --validate       # runs scripts/bench.py first (VALIDATE_BENCH_ARGS, ~14 min)

The same errors between two real runs (this VM's run-to-run noise: a floor for the above), and
between the simulator's own runs of a report's plan with seeds of their own (what chance alone
gives on that design: its window, its length spread):

    python scripts/simulate.py --noise-floor results/A/report.json results/B/report.json
    python scripts/simulate.py --sim-noise results/A/report.json --window 20 --length-spread 0.5

Planning on hardware described by published figures (keyacc_ray/sim/hardware.py: the H200 host,
an L40S beside two 8-channel Xeon sockets, cluster.yaml's shape serving a 70B model): per policy
the most clients within the scenario's TTFT/TPOT objective and the gains against gpu_only, as
markdown tables and a JSON line (docs/planning.md):

    python scripts/simulate.py --plan                      # every scenario
    python scripts/simulate.py --plan l40s-2socket --tpot-slo 0.3
    python scripts/simulate.py --plan l40s-2socket --options '{"cpu_prefill_max_s": 0}'   # the rule off

An hour of Poisson traffic on a scenario, to time the simulator:

    python scripts/simulate.py --hour l40s-2socket
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyacc_ray.bench.loadgen import Result, append_results, summarize  # noqa: E402
from keyacc_ray.bench.side_by_side import POLICIES, Plan, derive, window  # noqa: E402
from keyacc_ray.sim.corun import corun_factor  # noqa: E402
from keyacc_ray.sim.server import PoolSpec, ServerSpec, SimServer  # noqa: E402
from keyacc_ray.sim.steptime import StepTime  # noqa: E402
from keyacc_ray.sim.workload import SimRequest  # noqa: E402


def this_box(args, gpu: StepTime, cpu: StepTime) -> ServerSpec:
    """scripts/bench.py's graph on this box: the emulated GPU pool (8 sequences, a small KV
    budget) and the CPU pool, one core and one thread each, the serving stack over both cores."""
    own = POOL_OWN_CORES if args.pool_own_cores is None else args.pool_own_cores
    per_move = {k: v / 1e3 for k, v in (args.pool_own_ms_per_move or {}).items()}
    per_token = args.pool_ms_per_token / 1e3
    corun = args.corun_factor or {}
    return ServerSpec(PoolSpec(gpu, max_num_seqs=8, num_blocks=args.gpu_kv_blocks, block_size=16,
                               pool_s_per_token=per_token, own_cores=own.get("gpu", 0.0),
                               own_s_per_move=per_move.get("gpu", 0.0), corun_factor=corun.get("gpu", 1.0)),
                      PoolSpec(cpu, max_num_seqs=args.cpu_seqs, num_blocks=args.cpu_seqs * 64, block_size=16,
                               pool_s_per_token=per_token, own_cores=own.get("cpu", 0.0),
                               own_s_per_move=per_move.get("cpu", 0.0), corun_factor=corun.get("cpu", 1.0)),
                      kv_bytes_per_token=args.kv_bytes_per_token, handoff_bw_bytes_s=args.handoff_gbs * 1e9,
                      handoff_fixed_s=args.handoff_fixed_ms / 1e3, max_model_len=1024,
                      stack_s_per_token=args.stack_ms_per_token / 1e3, stack_cores=args.stack_cores,
                      stack_fixed_cores=args.stack_fixed_cores,
                      request_path_s=(REQUEST_PATH_MS if args.request_path_ms is None else args.request_path_ms) / 1e3,
                      hop_start_busy_s=(args.hop_start_busy_ms or 0.0) / 1e3,
                      step_jitter=args.step_jitter or 0.0)


ENGINES = ("gpu_decode", "gpu_prefill", "cpu_decode")
# --validate's real run: bench.py's levels and policies, with request lengths spread +-50% and 20 s
# windows. With equal lengths the closed loop's clients move in step, and a 10 s window's p50 TTFT
# swings with where that step falls: two seeds of the simulator itself (--sim-noise) differ by
# 0.11-0.18 in p50 TTFT MAPE, as two real runs did (0.17); spread lengths and 20 s windows bring
# that to 0.05-0.10 (docs/benchmarks.md, Simulator). Level by level (`--order level`): the cells
# harvest compares (each policy's top level, gpu_only's, the CPU pool alone) within ~3 minutes of each
# other instead of ~8, on a VM whose speed drifts 10-25% over minutes; and no timeline, whose
# /metrics scrape every 0.5 s takes CPU from the one cell it samples (auto's top level) and which the
# simulator does not model
VALIDATE_BENCH_ARGS = ["--levels", "2", "8", "24", "40", "--duration", "20", "--prompt-spread", "0.5",
                       "--output-spread", "0.5", "--low-load-rounds", "0", "--requests", "--order", "level",
                       "--timeline-policy", "none"]
# this Xeon VM, measured beside session 46's --validate run (results/sim-validate-20261205-235613):
# bench_stack.py --levels 1 --token-rate 2000, p50 TTFT; the replicas' own threads and the stack's
# claim, fit_stack on that run's report
REQUEST_PATH_MS = 8.6
GPU_PROFILE = "profile-gpu.json"  # --validate's profile of the emulated GPU pool's core, beside profile.json
TRACE_DIR = "steps"  # --validate's step trace of the real run (bench.py --trace-steps), beside its report
POOL_OWN_CORES = {"gpu": 0.06, "cpu": 0.06}
STACK_FIXED_CORES, STACK_MS_PER_TOKEN = 0.5, 0.0


def fit_step_jitter(real: dict, modelled: dict | None = None) -> float | None:
    """The spread of one engine step's time about the model's (coefficient of variation), from the
    real run's quietest cell: gpu_only at its lowest level (no moves, the fewest rows). A request's
    TPOT is the mean of its steps: with steps drawn apart independently, its spread is the step's
    over sqrt(steps); a TPOT's p50-p90 distance is 1.28 of its spread for a normal. What the model
    spreads by itself (`modelled`: the simulator's summary of that cell without jitter; requests of
    spread lengths meet other requests' prompts in some of their steps) is taken out, in quadrature.
    None without that cell."""
    def spread(r: dict | None) -> float:
        if not r or not r.get("tpot_p50_ms") or not r.get("tpot_p90_ms"):
            return 0.0
        return max(0.0, (r["tpot_p90_ms"] - r["tpot_p50_ms"]) / 1.2816 / r["tpot_p50_ms"])
    lv = (real.get("runs") or {}).get("gpu_only") or {}
    if not lv:
        return None
    r = lv[min(lv, key=int)]
    steps = (real.get("workload") or {}).get("output_tokens", 0) - 1
    if not r.get("tpot_p50_ms") or steps < 1:
        return None
    excess = max(0.0, spread(r) ** 2 - spread(modelled) ** 2) ** 0.5
    return round(min(0.5, excess * steps ** 0.5), 3)


def gpu_profile_beside(report: str) -> StepTime | None:
    """The emulated GPU pool's step profile that `--validate` fitted on its core beside a real run's
    report (GPU_PROFILE), if there is one (runs before ed11379 have one profile, of core 1)."""
    path = Path(report).with_name(GPU_PROFILE)
    return StepTime.load(str(path)) if path.exists() else None


def fit_corun(trace_dir: Path, gpu: StepTime, cpu: StepTime) -> dict[str, float]:
    """Each pool's `corun_factor` from the real run's step trace beside its report (`--validate`
    runs the bench with --trace-steps): how much more of its thread's CPU each engine's step took
    while the other pool's engine worked than while it worked alone, compared among steps of the
    same rows, with prompt tokens or without (keyacc_ray/sim/corun.py). Only traces whose records
    name their pool; a pool with no kind of step seen enough both ways keeps 1.0 (nothing where
    there is no trace)."""
    steps: dict[str, list[dict]] = {}
    for path in sorted(trace_dir.glob("steps-*.jsonl")) if trace_dir.is_dir() else []:
        for line in path.read_text().splitlines():
            s = json.loads(line)
            if s.get("pool") in ("gpu", "cpu"):
                steps.setdefault(s["pool"], []).append(s)
    if set(steps) != {"gpu", "cpu"}:
        return {}
    out = {}
    for pool, other, model in (("gpu", "cpu", gpu), ("cpu", "gpu", cpu)):
        f = corun_factor(steps[pool], steps[other], model)["factor"]
        if f:
            out[pool] = f
    return out


def fit_hop_start(real: dict) -> float | None:
    """How much longer a request's first hop waited for its replica to take it when the pools were
    working than when they were nearly idle (ms): the real trace's hop_start_p50_ms, the median
    over the cells above the lowest level less the median at the lowest (the one-client request
    path, measured beside the run, holds the idle part). None where the report has no such
    figures."""
    cells = [(int(lv), r["hop_start_p50_ms"]) for runs in real["runs"].values() for lv, r in runs.items()
             if r.get("hop_start_p50_ms") is not None]
    if not cells:
        return None
    low = min(lv for lv, _ in cells)
    idle = statistics.median(h for lv, h in cells if lv == low)
    busy = [h for lv, h in cells if lv > low]
    return round(max(0.0, statistics.median(busy) - idle), 2) if busy else None


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x with b kept >= 0 (a flat line at the mean when b would be less)
    and a kept >= 0 (a line through the origin when a would be less: cores, or cores per move,
    are never negative, and a few cells that rose steeply would otherwise give a fixed share
    below nothing)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    if my - slope * mx < 0:
        sxx = sum(x * x for x in xs)
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sxx) if sxx else 0.0
    return my - slope * mx, slope


def fit_stack(real: dict) -> dict | None:
    """What else the real run's own CPU accounting says took the engines' cores. The serving
    stack's claim, fitted as fixed cores + seconds per token over the runs where both pools worked
    (where the stack had no idle core to itself); None with fewer than two such runs. Where the
    run accounted each replica's engine thread apart (`engine_thread_cores`, newer reports), the
    claim is every core the two replicas did not get (the stack's processes and any time no
    process is billed for), and each replica's own other threads (its report loop, streaming,
    Serve's side: pinned with the engine, so on its core whatever the other core does) are
    `pool_own_cores` + `pool_own_s_per_move` x the requests moved a second (a move's export or
    import on the replica's Serve side), per pool over the runs where that pool worked. In older
    reports, the stack's processes' CPU alone, and the replicas' own cost stays --pool-ms-per-token."""
    cpus = (real.get("box") or {}).get("cpus") or 2
    runs = [r for lv in real["runs"].values() for r in lv.values()] + ([real["cpu_alone"]] if real.get("cpu_alone")
                                                                       else [])
    threads = all(r.get("engine_thread_cores") for r in runs)
    pts, own = [], {"gpu_decode": [], "cpu_decode": []}
    for r in runs:
        cu, et = r.get("cores_used") or {}, r.get("engine_thread_cores") or {}
        if threads:
            seconds = r["requests"] / r["req_per_s"] if r.get("requests") and r.get("req_per_s") else 0.0
            for k in own:
                if et.get(k, 0) > 0.3:
                    own[k].append(((r.get("moves") or 0) / seconds if seconds else 0.0, cu[k] - et[k]))
        if r is real.get("cpu_alone") or not r.get("output_tok_per_s"):
            continue
        if cu.get("gpu_decode", 0) > 0.3 and cu.get("cpu_decode", 0) > 0.3:
            pts.append((r["output_tok_per_s"], cpus - cu["gpu_decode"] - cu["cpu_decode"] if threads
                        else sum(v for k, v in cu.items() if k not in ENGINES)))
    if len(pts) < 2:
        return None
    fixed, slope = _line([p[0] for p in pts], [p[1] for p in pts])
    lines = {k.split("_")[0]: _line([x for x, _ in v], [y for _, y in v]) for k, v in own.items() if v}
    return {"fixed_cores": max(0.0, fixed), "s_per_token": slope, "runs": len(pts),
            "pool_own_cores": {k: round(a, 4) for k, (a, _) in lines.items()} if threads else None,
            "pool_own_s_per_move": {k: round(b, 5) for k, (_, b) in lines.items()} if threads else None}


def maker(wl: dict, seed: int, route: str | None = None):
    """The bench's request lengths (loadgen.Workload: a length uniform in n x (1 +- spread))."""
    rng = random.Random(seed)

    def length(n: int, spread: float) -> int:
        return max(1, round(rng.uniform(n * (1 - spread), n * (1 + spread)))) if spread else n

    def make(i: int) -> SimRequest:
        p, o = length(wl["prompt_tokens"], wl["prompt_spread"]), length(wl["output_tokens"], wl["output_spread"])
        return SimRequest(f"r{i}", p, o, o, route=route)
    return make


def as_results(done, half_path_s: float = 0.0) -> list[Result]:
    """The simulated requests as the load generator records real ones, with the server trace's
    timings of the first hop (from the request's start at the ingress: half the path after it left)."""
    def segments(lv) -> list[dict]:
        segs = [{"pool": p, "tokens": n} for p, n in lv.segments]
        if segs and lv.first_hop_t is not None and lv.first_made_t is not None:
            at_ingress = lv.req.arrival + half_path_s
            segs[0].update(start_ms=round((lv.first_hop_t - at_ingress) * 1e3, 2),
                           first_token_ms=round((lv.first_made_t - at_ingress) * 1e3, 2))
        return segs
    return [Result(lv.error is None, 200 if lv.error is None else 503, lv.req.arrival,
                   (lv.first_t - lv.req.arrival) if lv.first_t is not None else 0.0,
                   (lv.done_t - lv.req.arrival), list(lv.token_times), lv.generated,
                   segments(lv), lv.error or "") for lv in done]


def one_run(spec, policy, options, clients, plan: Plan, wl: dict, route=None, seeds: int = 1, keep=None) -> dict:
    """One (policy, level) run as the bench summarizes it; with `seeds` > 1 (and step jitter, else
    every seed runs alike) the mean of each figure over that many seeds: the simulator's expected
    figure, not one draw of it."""
    if not spec.step_jitter and not wl.get("prompt_spread") and not wl.get("output_spread"):
        seeds = 1  # nothing drawn: every seed would run alike
    runs = []
    for k in range(seeds):
        srv = SimServer(dataclasses.replace(spec, seed=spec.seed + k), policy, {} if policy == "gpu_only" else options)
        make = maker(wl, clients + 7919 * (spec.seed + k), route)
        done = srv.run_closed(clients, plan.ramp_s + plan.duration_s, make)
        results = as_results(done, spec.request_path_s / 2)
        if keep and k == 0:  # the first seed's requests, as bench.py --requests keeps real ones
            keep(results)
        runs.append(summarize(results, plan.ramp_s + plan.duration_s, plan.ttft_slo_ms / 1e3, plan.tpot_slo_ms / 1e3,
                              window(plan)))
    return mean_summary(runs)


def mean_summary(runs: list[dict]) -> dict:
    """Summaries (loadgen.summarize) of runs alike, as one: each number (also within a dict: the
    pools' token shares) the mean over the runs that have it; anything else the first run's."""
    if len(runs) == 1:
        return runs[0]

    def mean(vals):
        vals = [v for v in vals if v is not None and v == v]
        return round(sum(vals) / len(vals), 3) if vals else float("nan")
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = mean([r.get(k) for r in runs])
        elif isinstance(v, dict):
            keys = {kk for r in runs for kk in r.get(k, {})}
            out[k] = {kk: mean([r.get(k, {}).get(kk, 0.0) for r in runs]) for kk in sorted(keys)}
    return out


def side_by_side(spec, plan: Plan, wl: dict, options: dict, log=print, seeds: int = 1, keep=None) -> dict:
    """bench.py's side-by-side, simulated; `keep(name, results)` gets each run's requests (its first seed's)."""
    named = (lambda name: (lambda res: keep(name, res))) if keep else (lambda name: None)
    runs = {}
    for pol in plan.policies:
        runs[pol] = {}
        for c in plan.levels:
            s = runs[pol][c] = one_run(spec, pol, options, c, plan, wl, seeds=seeds, keep=named(f"{pol}/{c}"))
            log(f"{pol:<14} c={c:<3} tok/s={s['output_tok_per_s']:<7} ttft p50/p99={s['ttft_p50_ms']}/{s['ttft_p99_ms']}"
                f" tpot p50/p99={s['tpot_p50_ms']}/{s['tpot_p99_ms']} share={s['token_share']} moves={s['moves']}")
    alone = one_run(spec, "gpu_only", {}, max(plan.levels), plan, wl, route="cpu", seeds=seeds,
                    keep=named("cpu-alone"))
    log(f"{'cpu alone':<14} c={max(plan.levels):<3} tok/s={alone['output_tok_per_s']}")
    report = {"runs": runs, "cpu_alone": alone}
    report.update(derive(runs, alone, plan))
    return report


# Policies whose real peaks lie closer than this (relative) are ties: two real runs of the same
# code on this VM put auto 5% above full_offload, then full_offload 8% above auto (session 45's
# noise floor, docs/benchmarks.md)
RANK_TOLERANCE = 0.08


def ranking_agrees(real_peaks: dict, sim_peaks: dict, tolerance: float) -> bool:
    """Every pair of policies whose real peaks lie more than `tolerance` apart (the larger over the
    smaller) is ordered the same way by the simulation; closer pairs are ties, either order agrees."""
    return all(sim_peaks[a] > sim_peaks[b] for a in real_peaks for b in real_peaks
               if real_peaks[a] > real_peaks[b] * (1 + tolerance))


def report_plan(report: dict) -> Plan:
    """The side-by-side plan a bench report ran (its `plan`, less fields a Plan no longer has)."""
    return Plan(**{k: v for k, v in report["plan"].items() if k in Plan.__dataclass_fields__})


def compare(real: dict, sim: dict, rank_tolerance: float = RANK_TOLERANCE) -> dict:
    """The simulation's errors against a real report: mean absolute percentage errors over every
    (policy, level) of throughput, p50 TTFT and p50 TPOT; the largest harvest error; whether the
    policies rank the same by peak throughput (`ranking_agrees`: policies within `rank_tolerance`
    of each other tied; `ranking_agrees_strict`: the same order, ties or not). Levels may be keyed
    by number or by its string (a report read back from JSON) in either."""
    sim = {**sim, "runs": {p: {int(c): v for c, v in lv.items()} for p, lv in sim["runs"].items()}}

    def mape(key):
        errs = [abs(sim["runs"][p][c][key] - r[key]) / r[key] for p, lv in real["runs"].items()
                for c, r in ((int(k), v) for k, v in lv.items()) if r.get(key) and sim["runs"][p][c].get(key)]
        return round(sum(errs) / len(errs), 4) if errs else None
    harvest = [abs((sim["harvest_efficiency"].get(p) or 0) - (h or 0)) for p, h in real["harvest_efficiency"].items()
               if p != "gpu_only" and h is not None]
    rank = lambda rep: sorted(rep["peak_output_tok_per_s"], key=lambda p: -rep["peak_output_tok_per_s"][p])
    ranked = {"ranking_agrees": None}  # (peaks, gains and harvest are against gpu_only: a run without it has none)
    if "peak_output_tok_per_s" in real and "peak_output_tok_per_s" in sim:
        ranked = {"ranking_agrees": ranking_agrees(real["peak_output_tok_per_s"], sim["peak_output_tok_per_s"],
                                                   rank_tolerance),
                  "ranking_agrees_strict": rank(real) == rank(sim), "rank_tolerance": rank_tolerance,
                  "real_ranking": rank(real), "sim_ranking": rank(sim)}
    pairs = {p: {c: [r["output_tok_per_s"], sim["runs"][p][int(c)]["output_tok_per_s"]] for c, r in lv.items()}
             for p, lv in real["runs"].items()}
    pairs["cpu_alone"] = [real["cpu_alone"]["output_tok_per_s"], sim["cpu_alone"]["output_tok_per_s"]]
    return {"tok_s_real_sim": pairs, "throughput_mape": mape("output_tok_per_s"), "ttft_p50_mape": mape("ttft_p50_ms"),
            "tpot_p50_mape": mape("tpot_p50_ms"),
            # TTFT at the server's ingress (a report whose server traced it; else None)
            "ingress_ttft_p50_mape": mape("ingress_ttft_p50_ms"),
            "harvest_abs_err": round(max(harvest), 4) if harvest else None, **ranked}


def sim_noise(real: dict, spec: ServerSpec, window_s: float | None = None, spread: float | None = None,
              seeds: int = 4) -> dict:
    """The simulator's own run-to-run spread on a real report's plan: the plan simulated `seeds`
    times, each with seeds of its own (step jitter, request lengths), one seed a cell, and the
    errors (as --validate's) between every pair: what chance alone gives on that design, with no
    model error. `window_s` / `spread` replace the plan's measured window and the requests' length
    spread."""
    import itertools

    plan = report_plan(real)
    if window_s:
        plan = dataclasses.replace(plan, duration_s=window_s)
    wl = dict(real["workload"])
    if spread is not None:
        wl.update(prompt_spread=spread, output_spread=spread)
    reps = [side_by_side(dataclasses.replace(spec, seed=1000 * k), plan, wl, real.get("policy_options") or {},
                         log=lambda *a: None) for k in range(seeds)]
    out: dict = {}
    for a, b in itertools.combinations(reps, 2):
        got = compare(a, b)
        for k in ("throughput_mape", "ttft_p50_mape", "tpot_p50_mape", "harvest_abs_err"):
            out.setdefault(k, []).append(got[k])
    return {"pairs": out, "window_s": plan.duration_s, "length_spread": [wl["prompt_spread"], wl["output_spread"]],
            "step_jitter": spec.step_jitter, "seeds": seeds}


def plan_tables(names: list[str], args) -> None:
    import dataclasses

    from keyacc_ray.sim.hardware import SCENARIOS
    from keyacc_ray.sim.plan import plan

    out = []
    for name in names or list(SCENARIOS):
        sc = SCENARIOS[name]
        if args.tpot_slo or args.ttft_slo:
            sc = dataclasses.replace(sc, tpot_slo_s=args.tpot_slo or sc.tpot_slo_s, ttft_slo_s=args.ttft_slo or sc.ttft_slo_s)
        t0 = time.time()
        rep = plan(sc, args.policies, ramp_s=args.plan_ramp, measure_s=args.plan_measure,
                   log=print if args.verbose else None, options=args.options)
        rep["sim_wall_s"] = round(time.time() - t0, 1)
        out.append(rep)
        wl = sc.workload
        print(f"\n### {sc.title}\n\n{sc.model.name}; GPU pool {rep['gpu']} ({rep['gpu_bw_gb_s_total']:g} GB/s, "
              f"{rep['gpu_kv_tokens_per_replica']} KV tokens a replica); CPU pool {rep['cpu']} "
              f"(**CPU bandwidth {rep['cpu_bw_gb_s_per_replica']:g} GB/s a replica, {rep['cpu_bw_gb_s_total']:g} GB/s in "
              f"all**; {rep['cpu_slots_per_replica']} slots and {rep['cpu_prefill_chunk']} prompt tokens a step a replica, "
              f"from the TPOT objective). Batch-1 step: GPU {rep['gpu_step_ms_batch1']} ms, CPU {rep['cpu_step_ms_batch1']} "
              f"ms. Objective: p99 TTFT <= {sc.ttft_slo_s:g} s, p99 TPOT <= {sc.tpot_slo_s:g} s. Prompts "
              f"{wl.prompt_tokens[0]}-{wl.prompt_tokens[1]}, outputs {wl.output_tokens[0]}-{wl.output_tokens[1]} tokens "
              f"(max_tokens {wl.max_tokens}). {sc.notes}\n")
        print("| policy | clients within objective | output tok/s there | p99 TTFT s | p99 TPOT s | CPU token share | "
              "concurrency gain | throughput gain |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
        for p, r in rep["policies"].items():
            if r.get("note"):
                print(f"| {p} | - | - | - | - | - | - | - ({r['note']}) |")
                continue
            print(f"| {p} | {r['clients_within_slo']} | {r['output_tok_per_s']} | {r['ttft_p99_s']} | {r['tpot_p99_s']} | "
                  f"{r['cpu_token_share']} | {r['concurrency_gain']} | {r['throughput_gain']} |")
    print(json.dumps({"plan": out}))


def hour(name: str, args) -> None:
    """An hour of Poisson traffic at the rate the GPU pool alone would about serve, under auto."""
    from keyacc_ray.sim.hardware import SCENARIOS
    from keyacc_ray.sim.plan import POLICY_OPTIONS
    from keyacc_ray.sim.report import summarize
    from keyacc_ray.sim.server import SimServer
    from keyacc_ray.sim.workload import Workload

    sc = SCENARIOS[name]
    wl = sc.workload
    gen = Workload(kind="poisson", rate=args.rate, duration_s=3600.0, prompt_tokens=wl.prompt_tokens,
                   output_tokens=wl.output_tokens, max_tokens=wl.max_tokens, seed=1)
    reqs = gen.requests()
    t0 = time.time()
    srv = SimServer(sc.spec(), "auto", POLICY_OPTIONS)
    done = srv.run(reqs)
    s = summarize(done)
    print(json.dumps({"scenario": name, "simulated_s": round(srv.now, 1), "requests": len(reqs),
                      "output_tokens": s["output_tokens"], "cpu_token_share": s["cpu_token_share"],
                      "ttft_p99_s": s["ttft_p99_s"], "tpot_p99_s": s["tpot_p99_s"], "wall_s": round(time.time() - t0, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="this-box-medium-cpu", help="step-time profile of both pools' devices")
    ap.add_argument("--gpu-profile", default=None, help="the GPU pool's profile, if another")
    ap.add_argument("--validate", metavar="REPORT", nargs="?", const="run",
                    help="a scripts/bench.py report.json to simulate and compare; without one, run "
                         "`scripts/bench.py` first (VALIDATE_BENCH_ARGS; about 14 minutes here) and compare with its "
                         "report")
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 8, 24, 40])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--ramp", type=float, default=4.0)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--period", type=int, default=32)
    ap.add_argument("--gpu-kv-blocks", type=int, default=40)
    ap.add_argument("--cpu-seqs", type=int, default=32)
    ap.add_argument("--kv-bytes-per-token", type=int, default=16384, help="medium-qwen3 in float32: 8 x 4 x 64 x 2 x 4")
    ap.add_argument("--handoff-gbs", type=float, default=1.0, help="KV hand-off bandwidth, GB/s (object store here)")
    ap.add_argument("--handoff-fixed-ms", type=float, default=10.0, help="fixed cost of a hand-off (calls, export)")
    ap.add_argument("--stack-ms-per-token", type=float, default=STACK_MS_PER_TOKEN, help="the stack's claim on "
                    "the engines' cores per token/s (--validate fits it from the real run)")
    ap.add_argument("--pool-ms-per-token", type=float, default=0.0, help="a pool replica's CPU per token beyond "
                    "the engine's step, on its core (older reports, without the engine threads accounted apart)")
    ap.add_argument("--pool-own-cores", type=json.loads, default=None, help='each replica\'s own threads beyond '
                    'its engine\'s, on the engine\'s core while it works, JSON per pool (default '
                    f'{json.dumps(POOL_OWN_CORES)}); --validate fits it from a report that accounts the engine threads '
                    'apart')
    ap.add_argument("--pool-own-ms-per-move", type=json.loads, default=None, help="each replica's own threads' "
                    "CPU per request moved between the pools (either way), ms, JSON per pool (default none); "
                    "--validate fits it beside --pool-own-cores")
    ap.add_argument("--corun-factor", type=json.loads, default=None, help="each pool's steps' cost beside the "
                    "other pool's engine against alone, JSON per pool (default 1.0; --validate fits it from the "
                    "real run's step trace, `steps/` beside its report)")
    ap.add_argument("--stack-cores", type=float, default=2.0, help="cores the stack shares with the engines")
    ap.add_argument("--hop-start-busy-ms", type=float, default=None, help="how much longer a request's first hop "
                    "waits for its replica when that replica's engine works (default 0; --validate fits it from the "
                    "real run's hop_start_p50_ms)")
    ap.add_argument("--request-path-ms", type=float, default=None, help="the stack's own latency on a request's "
                    "way in and its tokens' way out, with no queue (default: what --validate measured beside the "
                    f"real run, else {REQUEST_PATH_MS} ms: scripts/bench_stack.py --levels 1 --token-rate 2000)")
    ap.add_argument("--stack-fixed-cores", type=float, default=STACK_FIXED_CORES, help="the stack's fixed claim on "
                    "the engines' cores (--validate fits it from the real run)")
    ap.add_argument("--no-stack-fit", action="store_true", help="--validate: keep the stack figures given, "
                    "not the real run's own CPU accounting")
    ap.add_argument("--step-jitter", type=float, default=None, help="the spread of a step's time about the "
                    "model's (coefficient of variation; default 0, and with --validate what the real run shows: "
                    "fit_step_jitter)")
    ap.add_argument("--seeds", type=int, default=8, help="simulated runs per (policy, level), their figures "
                    "averaged (each draws its own step jitter and request lengths; alike without either)")
    ap.add_argument("--noise-floor", nargs=2, metavar="REPORT", help="the same errors between two real runs "
                    "(scripts/bench.py reports): what this box's run-to-run noise alone gives")
    ap.add_argument("--requests-out", metavar="FILE", help="--validate: the simulated requests (each cell's first "
                    "seed) as JSON lines, as bench.py --requests keeps real ones (requests_report.py reads both)")
    ap.add_argument("--sim-noise", metavar="REPORT", help="the simulator's own spread on a real report's plan: "
                    "4 simulations, seeds of their own (--step-jitter, default here 0.1), the errors between each pair")
    ap.add_argument("--window", type=float, default=None, help="--sim-noise: the measured window, s (else the plan's)")
    ap.add_argument("--length-spread", type=float, default=None, help="--sim-noise: requests' length spread (else "
                    "the report's)")
    ap.add_argument("--plan", nargs="*", metavar="SCENARIO", help="plan on these scenarios (none named: all)")
    ap.add_argument("--ttft-slo", type=float, default=None, help="--plan: p99 TTFT objective, s (else the scenario's)")
    ap.add_argument("--tpot-slo", type=float, default=None, help="--plan: p99 TPOT objective, s (else the scenario's)")
    ap.add_argument("--options", type=json.loads, default={},
                    help='--plan: policy options over the planning defaults, JSON (e.g. \'{"cpu_prefill_max_s": 0}\')')
    ap.add_argument("--plan-ramp", type=float, default=30.0, help="--plan: seconds before each run's window")
    ap.add_argument("--plan-measure", type=float, default=90.0, help="--plan: each run's measured window, s")
    ap.add_argument("--hour", metavar="SCENARIO", help="simulate an hour of Poisson traffic on a scenario")
    ap.add_argument("--rate", type=float, default=3.0, help="--hour: requests per second")
    ap.add_argument("--verbose", action="store_true", help="--plan: every run of the search")
    args = ap.parse_args()
    if args.noise_floor:
        a, b = (json.loads(Path(p).read_text()) for p in args.noise_floor)
        out = compare(a, b)
        out.pop("tok_s_real_sim")
        print(json.dumps({**out, "reports": args.noise_floor}))
        return
    if args.sim_noise:
        real = json.loads(Path(args.sim_noise).read_text())
        args.step_jitter = 0.1 if args.step_jitter is None else args.step_jitter
        prof = StepTime.load(args.profile)
        print(json.dumps(sim_noise(real, this_box(args, prof, prof), args.window, args.length_spread)))
        return
    if args.plan is not None:
        return plan_tables(args.plan, args)
    if args.hour:
        return hour(args.hour, args)
    cpu = StepTime.load(args.profile)
    gpu = StepTime.load(args.gpu_profile) if args.gpu_profile else cpu
    t0 = time.time()
    if args.validate == "run":  # the real side-by-side first, in this invocation
        import subprocess

        out_dir = ROOT / "results" / f"sim-validate-{time.strftime('%Y%m%d-%H%M%S')}"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *VALIDATE_BENCH_ARGS, "--out-dir",
                        str(out_dir), "--trace-steps", str(out_dir / TRACE_DIR)], check=True)
        args.validate = str(out_dir / "report.json")
        # and the step-time profile right after it: this VM's speed moves 1.5-2x between minutes, and a
        # profile fitted another hour made the simulated pools 15-30% off
        # each on the core its pool runs on (bench.py pins the emulated GPU pool to core 0, the CPU
        # pool to core 1): this VM's two cores need not keep one speed (run I, docs/benchmarks.md)
        for core, name in ((1, "profile.json"), (0, GPU_PROFILE)):
            subprocess.run([sys.executable, str(ROOT / "scripts" / "sim_calibrate.py"), "--model",
                            str(ROOT / "models" / "medium-qwen3"), "--device", "cpu", "--threads", "1",
                            "--cpu-affinity", str(core), "--reps", "9", "--out", str(out_dir / name)], check=True)
        cpu, gpu = StepTime.load(str(out_dir / "profile.json")), StepTime.load(str(out_dir / GPU_PROFILE))
        # and the stack's own request path: one client over the stand-in engine (its first token
        # within 0.5 ms), p50 TTFT
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_stack.py"), "--levels", "1", "--token-rate",
                            "2000", "--seconds", "10", "--ramp", "2", "--idle-seconds", "1"], check=True,
                           capture_output=True, text=True)
        (out_dir / "stack_path.json").write_text(r.stdout.strip().splitlines()[-1] + "\n")
    stack_fit = None
    if args.validate:
        real = json.loads(Path(args.validate).read_text())
        if args.gpu_profile is None and gpu is cpu:
            gpu = gpu_profile_beside(args.validate) or gpu
        path = Path(args.validate).with_name("stack_path.json")  # measured beside the real run (above)
        if path.exists() and args.request_path_ms is None:
            args.request_path_ms = json.loads(path.read_text())["levels"]["1"]["ttft_p50_ms"]
        stack_fit = None if args.no_stack_fit else fit_stack(real)
        jitter_fit = args.step_jitter is None
        if args.hop_start_busy_ms is None:
            args.hop_start_busy_ms = fit_hop_start(real)
        if args.corun_factor is None:
            args.corun_factor = fit_corun(Path(args.validate).with_name(TRACE_DIR), gpu, cpu)
        if stack_fit:
            args.stack_fixed_cores, args.stack_ms_per_token = stack_fit["fixed_cores"], stack_fit["s_per_token"] * 1e3
            if stack_fit["pool_own_cores"]:
                args.pool_ms_per_token, args.pool_own_cores = 0.0, stack_fit["pool_own_cores"]
                if args.pool_own_ms_per_move is None:
                    args.pool_own_ms_per_move = {k: v * 1e3 for k, v in stack_fit["pool_own_s_per_move"].items()}
            elif args.pool_own_cores is None:  # an older report: no engine threads to tell the own cores by
                args.pool_own_cores = {}
    spec = this_box(args, gpu, cpu)
    if args.validate:
        plan = report_plan(real)
        wl = real["workload"]
        if jitter_fit:  # the real run's step spread beyond what the model's own steps spread
            low = min(plan.levels)
            quiet = one_run(spec, "gpu_only", {}, low, plan, wl, seeds=args.seeds)
            args.step_jitter = fit_step_jitter(real, quiet) or 0.0
            spec = dataclasses.replace(spec, step_jitter=args.step_jitter)
        keep = None
        if args.requests_out:  # the simulated requests as bench.py --requests keeps real ones
            Path(args.requests_out).write_text("")
            keep = functools.partial(append_results, args.requests_out)
        sim = side_by_side(spec, plan, wl, real.get("policy_options") or {}, seeds=args.seeds, keep=keep)
        out = {**compare(real, sim), "sim_wall_s": round(time.time() - t0, 2), "profile": cpu.name,
               "real_report": args.validate,
               "request_path_ms": args.request_path_ms, "hop_start_busy_ms": args.hop_start_busy_ms,
               "step_jitter": args.step_jitter, "seeds": args.seeds, "corun_factor": args.corun_factor,
               "stack": {"fixed_cores": round(args.stack_fixed_cores, 3), "ms_per_token": round(args.stack_ms_per_token, 3),
                         "fitted_on_runs": stack_fit["runs"] if stack_fit else 0,
                         "pool_own_cores": args.pool_own_cores, "pool_ms_per_token": args.pool_ms_per_token,
                         "pool_own_ms_per_move": {k: round(v, 2)
                                                  for k, v in (args.pool_own_ms_per_move or {}).items()}}}
    else:
        plan = Plan(levels=args.levels, duration_s=args.duration, ramp_s=args.ramp, policies=args.policies)
        wl = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "prompt_spread": 0.0,
              "output_spread": 0.0}
        options = {"trigger_window_s": 0.3, "return_window_s": 1.0, "decode_period_tokens": args.period}
        rep = side_by_side(spec, plan, wl, options, seeds=args.seeds)
        out = {k: rep.get(k) for k in ("concurrency_gain", "throughput_gain", "harvest_efficiency",
                                        "peak_output_tok_per_s")}  # (the gains need gpu_only among --policies)
        out.update({"sim_wall_s": round(time.time() - t0, 2), "profile": cpu.name})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
