#!/usr/bin/env python3
"""Where a bench run's requests went and waited, from `scripts/bench.py --requests`'s
requests.jsonl (every measured request: its token times and the server's trace).

    python scripts/requests_report.py results/bench-XXXX/requests.jsonl
    python scripts/requests_report.py results/bench-XXXX/requests.jsonl --runs stage_offload/24 full_offload/24

Per run (policy/clients, cpu-alone): the paths taken (the pools of a request's segments, in
order) and their shares; for segments that began with a hand-off, the hand-off's wait (the
trace's `handoff_ms`: from the end of the last hop to the next replica taking it) and the time
from that replica taking it to its first token at the ingress; the client's gap at the move
(between its last token before and its first token after); and each segment's longest waits:
at the ingress between two tokens (`ingress_gap_ms`), in the replica between the engine steps
that made them (`made_gap_ms`) and for its event loop (`loop_lag_ms`); a segment's own TPOT per
pool (its first token to its last, as the client got them). p50 / p90 / max in ms. `simulate.py
--validate REPORT --requests-out FILE` writes the simulated requests in the same form.
Its last line is one JSON object with the same figures.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyacc_ray.bench.loadgen import pct  # noqa: E402


def pcts(xs: list[float]) -> list[float] | None:
    """p50, p90 and max (the bench's percentiles: loadgen.pct)."""
    return [round(pct(xs, 50), 1), round(pct(xs, 90), 1), round(max(xs), 1)] if xs else None


def report(rows: list[dict]) -> dict:
    paths: collections.Counter = collections.Counter()
    handoff, to_first, at_move, ingress_gap, made_gap, loop_lag = [], [], [], [], [], []
    seg_tpot: dict[str, list[float]] = collections.defaultdict(list)
    for r in rows:
        segs = r.get("segments") or []
        paths["->".join(s["pool"] for s in segs)] += 1
        done = 0  # tokens the client had before each segment
        for i, s in enumerate(segs):
            if i and "handoff_ms" in s:
                handoff.append(s["handoff_ms"])
                if "first_token_ms" in s and "start_ms" in s:
                    to_first.append(s["first_token_ms"] - s["start_ms"])
            tt = r.get("token_times") or []
            per_token = len(tt) == r.get("output_tokens")  # a time per token (a server that sends ids)
            if i and 0 < done < len(tt) and per_token:
                at_move.append((tt[done] - tt[done - 1]) * 1e3)
            n = s.get("tokens", 0)
            if per_token and n >= 2 and done + n <= len(tt):  # the segment's own pace, as its client saw it
                seg_tpot[s["pool"]].append((tt[done + n - 1] - tt[done]) / (n - 1) * 1e3)
            done += n
            for key, into in (("ingress_gap_ms", ingress_gap), ("made_gap_ms", made_gap), ("loop_lag_ms", loop_lag)):
                if key in s:
                    into.append(s[key])
    n = len(rows) or 1
    return {"requests": len(rows), "paths": {p: round(c / n, 3) for p, c in paths.most_common()},
            "handoff_ms": pcts(handoff), "moved_start_to_first_token_ms": pcts(to_first),
            "client_gap_at_move_ms": pcts(at_move), "ingress_gap_ms": pcts(ingress_gap),
            "made_gap_ms": pcts(made_gap), "loop_lag_ms": pcts(loop_lag),
            "segment_tpot_ms": {p: pcts(v) for p, v in sorted(seg_tpot.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("requests", help="a bench run's requests.jsonl (scripts/bench.py --requests)")
    ap.add_argument("--runs", nargs="*", help="only these runs (policy/clients, cpu-alone)")
    args = ap.parse_args()
    by_run: dict[str, list[dict]] = collections.defaultdict(list)
    with open(args.requests) as f:
        for line in f:
            row = json.loads(line)
            if row.get("ok") and (not args.runs or row["run"] in args.runs):
                by_run[row["run"]].append(row)
    out = {}
    for run, rows in by_run.items():
        out[run] = rep = report(rows)
        top = ", ".join(f"{p} {s:.0%}" for p, s in list(rep["paths"].items())[:4])
        print(f"{run:<20} n={rep['requests']:<4} {top}; hand-off {rep['handoff_ms']}, then first token "
              f"{rep['moved_start_to_first_token_ms']}, client gap at the move {rep['client_gap_at_move_ms']}; "
              f"a segment's TPOT by pool {rep['segment_tpot_ms']}; "
              f"longest waits: ingress {rep['ingress_gap_ms']}, engine {rep['made_gap_ms']}, "
              f"replica loop {rep['loop_lag_ms']}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
