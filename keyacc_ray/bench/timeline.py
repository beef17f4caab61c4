"""A timeline of one run from the server's own /metrics: queue depth per pool (and the requests
the router holds for a place, as pool "router"), requests moved each way and tokens/s per pool,
sampled every `interval_s` while the load runs."""
from __future__ import annotations

import asyncio
import re
import time

import httpx

_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), float(m.group(4))))
    return out


def reduce_sample(samples: list[tuple[str, dict, float]]) -> dict:
    """One scrape -> {queue: {pool: n}, running: {pool: n}, tokens: {pool: total}, moves: {"gpu->cpu": n}}."""
    out: dict = {"queue": {}, "running": {}, "tokens": {}, "moves": {}}
    for name, labels, v in samples:
        pool = labels.get("pool")
        if name == "keyacc_queue_depth":
            out["queue"][pool] = out["queue"].get(pool, 0) + v
        elif name == "keyacc_requests_held":  # waiting at the router for a place on either pool
            out["queue"]["router"] = v
        elif name == "keyacc_running_sequences":
            out["running"][pool] = out["running"].get(pool, 0) + v
        elif name == "keyacc_tokens_generated_total":
            out["tokens"][pool] = out["tokens"].get(pool, 0) + v
        elif name == "keyacc_moves_total":
            key = f"{labels.get('from')}->{labels.get('to')}"
            out["moves"][key] = out["moves"].get(key, 0) + v
    return out


def to_series(raw: list[tuple[float, dict]]) -> dict:
    """Scrapes -> per-interval series: queue depth and running per pool, tokens/s per pool (from
    counter differences) and moves per interval each way."""
    series: dict = {"t": [], "queue": {}, "running": {}, "tokens_per_s": {}, "moves": {}}
    for (t0, a), (t1, b) in zip(raw, raw[1:]):
        dt = max(t1 - t0, 1e-6)
        series["t"].append(round(t1, 3))
        for key in ("queue", "running"):
            for pool in set(a[key]) | set(b[key]):
                series[key].setdefault(pool, []).append(b[key].get(pool, 0))
        for pool in set(a["tokens"]) | set(b["tokens"]):
            series["tokens_per_s"].setdefault(pool, []).append(
                round(max(0.0, b["tokens"].get(pool, 0) - a["tokens"].get(pool, 0)) / dt, 1))
        for way in set(a["moves"]) | set(b["moves"]):
            series["moves"].setdefault(way, []).append(max(0.0, b["moves"].get(way, 0) - a["moves"].get(way, 0)))
    n = len(series["t"])
    for key in ("queue", "running", "tokens_per_s", "moves"):  # a pool first seen late: pad the front
        for k, v in series[key].items():
            series[key][k] = [0] * (n - len(v)) + v
    return series


async def sample_metrics(url: str, stop: asyncio.Event, interval_s: float = 0.5,
                         headers: dict | None = None) -> dict:
    raw: list[tuple[float, dict]] = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=5, headers=headers or {}) as client:
        while not stop.is_set():
            try:
                r = await client.get("/metrics")
                if r.status_code == 200:
                    raw.append((time.perf_counter() - t0, reduce_sample(parse_prometheus(r.text))))
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
    return to_series(raw)
