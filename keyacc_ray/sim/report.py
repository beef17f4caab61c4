"""A simulated run's figures, in the bench harness's terms: output tokens/s, TTFT and TPOT
quantiles, tokens and time per pool, moves, failures."""
from __future__ import annotations


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(done: list, engines: dict | None = None) -> dict:
    ok = [lv for lv in done if lv.error is None and lv.first_t is not None]
    if not ok:
        return {"requests": len(done), "failed": len(done)}
    start = min(lv.req.arrival for lv in done)
    end = max(lv.done_t for lv in ok)
    tokens = sum(lv.generated for lv in ok)
    ttft = [lv.first_t - lv.req.arrival for lv in ok]
    tpot = [(lv.done_t - lv.first_t) / (lv.generated - 1) for lv in ok if lv.generated > 1]
    per_pool: dict[str, int] = {}
    for lv in ok:
        for pool, n in lv.segments:
            per_pool[pool] = per_pool.get(pool, 0) + n
    out = {"requests": len(done), "failed": len(done) - len(ok), "duration_s": round(end - start, 3),
           "output_tokens": tokens, "output_tokens_per_s": round(tokens / max(end - start, 1e-9), 2),
           "ttft_p50_s": _q(ttft, 0.5), "ttft_p99_s": _q(ttft, 0.99), "tpot_p50_s": _q(tpot, 0.5),
           "tpot_p99_s": _q(tpot, 0.99), "tokens_per_pool": per_pool,
           "cpu_token_share": round(per_pool.get("cpu", 0) / tokens, 4) if tokens else 0.0,
           "moves": sum(lv.moves for lv in ok),
           "requests_touching_cpu": sum(any(p == "cpu" for p, _ in lv.segments) for lv in ok)}
    if engines:
        out["busy_share"] = {name: round(e.busy_s / max(end - start, 1e-9), 3) for name, e in engines.items()}
    return out
