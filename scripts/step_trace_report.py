#!/usr/bin/env python3
"""Real engine steps against the simulator's step model: the records of `KEYACC_STEP_TRACE_DIR`
(keyacc_ray/engine/step_trace.py; `scripts/bench.py --trace-steps DIR` sets it) read against a
step-time profile (keyacc_ray/sim/steptime.py).

    python scripts/step_trace_report.py DIR --profile results/sim-validate-XXXX/profile.json

Per engine process (its file) and per run in it (steps with less than --gap seconds between them;
a bench run's policies and levels follow one another with a pause): steps, span, mean decode rows,
steps with prompt tokens, imported sequences; `cpu_vs_model` (the engine thread's CPU over what
the profile says for each step's rows, prompt tokens, KV and attention pairs: the model's error
on the step's own work), `wall_vs_cpu` (wall over thread CPU: time the thread spent off a core
or waiting for the GIL, which the simulator models as the serving stack's claim and the
replica's own threads), `busy` (steps' wall over the span) and `cores` (thread CPU over the span).
Its last line is one JSON object with the same figures.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyacc_ray.sim.steptime import StepTime  # noqa: E402


def runs_of(steps: list[dict], gap_s: float) -> list[list[dict]]:
    out: list[list[dict]] = []
    for s in steps:
        if not out or s["t"] - out[-1][-1]["t"] > gap_s:
            out.append([])
        out[-1].append(s)
    return out


def summary(run: list[dict], model: StepTime) -> dict:
    span = max(run[-1]["t"] - run[0]["t"] + run[0]["wall_s"], 1e-9)
    wall, cpu = sum(s["wall_s"] for s in run), sum(s["cpu_s"] for s in run)
    pred = sum(model.seconds(s["prompt_tokens"], s["rows"], s["kv_tokens"], s["attn_pairs"]) for s in run)
    return {"steps": len(run), "span_s": round(span, 1), "rows_mean": round(sum(s["rows"] for s in run) / len(run), 1),
            "prompt_steps": sum(1 for s in run if s["prompt_tokens"]), "imports": sum(s["imports"] for s in run),
            "cpu_vs_model": round(cpu / pred, 3) if pred else None, "wall_vs_cpu": round(wall / cpu, 3) if cpu else None,
            "busy": round(wall / span, 3), "cores": round(cpu / span, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the trace directory (steps-<pid>.jsonl files)")
    ap.add_argument("--profile", required=True, help="a step-time profile (name or path)")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds without a step that end a run")
    ap.add_argument("--min-steps", type=int, default=20, help="runs with fewer steps are left out")
    args = ap.parse_args()
    model = StepTime.load(args.profile)
    out = {}
    for path in sorted(glob.glob(os.path.join(args.dir, "steps-*.jsonl"))):
        steps = [json.loads(line) for line in open(path)]
        if not steps:
            continue
        name = Path(path).stem
        out[name] = [summary(r, model) for r in runs_of(steps, args.gap) if len(r) >= args.min_steps]
        for i, s in enumerate(out[name]):
            print(f"{name} run {i}: " + ", ".join(f"{k} {v}" for k, v in s.items()), file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
