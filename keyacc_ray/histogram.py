"""Latency and size buckets (vLLM's, so its dashboards' quantiles read the same) and a plain
histogram an engine keeps for its load reports (Prometheus itself lives in serve/metrics.py)."""
from __future__ import annotations

from bisect import bisect_left

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # end to end, queue time
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# What each engine measures of its own sequences (in its load reports; per pool in /metrics, vLLM's
# names): name -> (buckets, help). A sequence that moves between pools is measured by each engine
# for its part (a hop).
ENGINE_HISTOGRAMS = {
    "vllm:request_queue_time_seconds": (REQUEST_BUCKETS, "From arrival at a pool's engine to first scheduled there"),
    "vllm:request_prefill_time_seconds": (REQUEST_BUCKETS, "From first scheduled to the first token, for the "
                                          "prompts a pool's engine prefilled"),
    "vllm:request_decode_time_seconds": (REQUEST_BUCKETS, "From the first token on a pool's engine to leaving it "
                                         "(finished, or handed off), per hop"),
    "vllm:request_inference_time_seconds": (REQUEST_BUCKETS, "From first scheduled on a pool's engine to leaving it, "
                                            "per hop"),
    "vllm:iteration_tokens_total": (ITERATION_BUCKETS, "Tokens fed per engine step (prompt chunks and decode rows)"),
}


class Histogram:
    """Counts per bucket (a value goes to the first bound it does not exceed; the last count is
    past every bound) and the sum of the values."""

    def __init__(self, buckets=REQUEST_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.sum += v

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


def merge(a: dict | None, b: dict | None) -> dict | None:
    """Two Histogram.to_dict()s summed (the first kept where their buckets differ)."""
    if not b:
        return a
    if not a:
        return {"buckets": list(b["buckets"]), "counts": list(b["counts"]), "sum": b["sum"]}
    if a["buckets"] != b["buckets"]:
        return a
    return {"buckets": a["buckets"], "counts": [x + y for x, y in zip(a["counts"], b["counts"])],
            "sum": a["sum"] + b["sum"]}


def sum_stats(dicts: list[dict]) -> dict:
    """Several cumulative request-figure dicts ({"counts": [[name, labels, value]...], "hists":
    [[name, labels, Histogram.to_dict()]...]}, serve/metrics.RequestStats) as one."""
    counts: dict[tuple, float] = {}
    hists: dict[tuple, dict] = {}
    for d in dicts:
        for n, lab, v in d.get("counts", []):
            counts[(n, tuple(lab))] = counts.get((n, tuple(lab)), 0.0) + v
        for n, lab, h in d.get("hists", []):
            hists[(n, tuple(lab))] = merge(hists.get((n, tuple(lab))), h)
    return {"counts": [[n, list(lab), v] for (n, lab), v in counts.items()],
            "hists": [[n, list(lab), h] for (n, lab), h in hists.items()]}
