"""A closed-loop load generator for any OpenAI-compatible /v1/completions endpoint.

Each of `concurrency` clients sends streaming requests back to back for `duration_s`.
Prompts are random token ids of a fixed length, outputs a fixed number of tokens (`ignore_eos`,
a documented request extension), seeded, so runs are comparable. Per request it records TTFT,
the arrival time of every token, and the `keyacc` trace (where it ran)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Workload:
    prompt_tokens: int = 64
    output_tokens: int = 128
    vocab_low: int = 10
    vocab_high: int = 500
    seed: int = 0


@dataclass
class Result:
    ok: bool
    status: int
    start_s: float
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    segments: list[dict] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], n: int,
                      extra: dict | None = None) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, **(extra or {})}
    t0 = time.perf_counter()
    res = Result(False, 0, t0)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:300]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "")
                    return res
                now = time.perf_counter() - t0
                for c in chunk.get("choices", []):
                    k = len(c.get("token_ids", []))
                    if k and not res.token_times:
                        res.ttft_s = now
                    res.token_times.extend([now] * k)
                    res.output_tokens += k
                if chunk.get("keyacc"):
                    res.segments = chunk["keyacc"]["segments"]
        res.e2e_s = time.perf_counter() - t0
        res.ok = res.output_tokens == n
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def closed_loop(url: str, model: str, concurrency: int, duration_s: float, wl: Workload,
                      extra: dict | None = None, progress=None) -> tuple[list[Result], float]:
    rng = random.Random(wl.seed)
    results: list[Result] = []
    deadline = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def worker():
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(wl.vocab_low, wl.vocab_high) for _ in range(wl.prompt_tokens)]
                results.append(await one_request(client, model, prompt, wl.output_tokens, extra))
                if progress:
                    progress(len(results))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarize(results: list[Result], wall_s: float, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:]) if b > a]
    tokens = sum(r.output_tokens for r in ok)
    pool_tokens: dict[str, int] = {}
    moves = 0
    for r in ok:
        moves += sum(1 for a, b in zip(r.segments, r.segments[1:]) if a["pool"] != b["pool"])
        for s in r.segments:
            pool_tokens[s["pool"]] = pool_tokens.get(s["pool"], 0) + s["tokens"]
    good = [r for r in ok if r.ttft_s <= ttft_slo_s and (r.tpot_s or 0) <= tpot_slo_s]
    total_pool = sum(pool_tokens.values()) or 1
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "req_per_s": round(len(ok) / wall_s, 3), "output_tok_per_s": round(tokens / wall_s, 1),
        "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 1), "ttft_p90_ms": round(pct(ttft, 90) * 1e3, 1),
        "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1),
        "tpot_p50_ms": round(pct(tpot, 50) * 1e3, 2), "tpot_p90_ms": round(pct(tpot, 90) * 1e3, 2),
        "tpot_p99_ms": round(pct(tpot, 99) * 1e3, 2),
        "itl_p50_ms": round(pct(itl, 50) * 1e3, 2), "itl_p99_ms": round(pct(itl, 99) * 1e3, 2),
        "e2e_p50_ms": round(pct([r.e2e_s for r in ok], 50) * 1e3, 1),
        "e2e_p99_ms": round(pct([r.e2e_s for r in ok], 99) * 1e3, 1),
        "goodput_req_per_s": round(len(good) / wall_s, 3),
        "token_share": {k: round(v / total_pool, 3) for k, v in sorted(pool_tokens.items())},
        "moves": moves,
        "errors": sorted({r.error for r in results if r.error})[:3],
    }
