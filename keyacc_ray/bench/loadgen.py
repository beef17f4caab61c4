"""A load generator for any OpenAI-compatible /v1/completions endpoint.

Closed loop: each of `concurrency` clients sends streaming requests back to back for
`duration_s`. Open loop: requests arrive at a Poisson rate for `duration_s`, whatever the server
is doing. Prompts are random token ids, outputs a fixed number of tokens (`ignore_eos`, a
documented request extension, so runs are comparable), lengths fixed or uniformly spread,
seeded. Each run draws prompts of its own (`prompt_rng`): a run that replayed an earlier run's
prompts (the same seed each time, as this harness did until session 46) finds their prefixes in the
server's cache and prefills less than a run of new prompts would (the bench's CPU pool alone
prefilled 43% fewer prompt tokens than its requests held). Per request it records TTFT, the
arrival time of every token, and the `keyacc` trace (where it ran), when the server sends one.

The client is aiohttp (it comes with ray[serve]): on a box where the load generator shares the
cores with the server, its CPU per streamed chunk is CPU the server does not get."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Workload:
    prompt_tokens: int = 64
    output_tokens: int = 128
    prompt_spread: float = 0.0  # lengths uniform in [n * (1 - spread), n * (1 + spread)]
    output_spread: float = 0.0
    vocab_low: int = 10
    vocab_high: int = 500
    seed: int = 0

    def sample(self, rng: random.Random) -> tuple[list[int], int]:
        def length(n: int, spread: float) -> int:
            return max(1, round(rng.uniform(n * (1 - spread), n * (1 + spread)))) if spread else n

        prompt = [rng.randrange(self.vocab_low, self.vocab_high) for _ in range(length(self.prompt_tokens,
                                                                                         self.prompt_spread))]
        return prompt, length(self.output_tokens, self.output_spread)


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

    wanted: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def sse_events(response: aiohttp.ClientResponse):
    """The JSON objects of a streamed completion's `data:` lines, one at a time ([DONE] ends it)."""
    async for raw in response.content:  # one line at a time
        if raw.startswith(b"data: ") and not raw.startswith(b"data: [DONE]"):
            yield json.loads(raw[6:])


async def one_request(client: aiohttp.ClientSession, model: str, prompt: list[int], n: int,
                      extra: dict | None = None) -> Result:
    """One streaming completion. Tokens are counted from `token_ids` when the server sends them
    (keyacc's `return_token_ids`), else one per text chunk, and the final usage block (asked for
    with `stream_options.include_usage`) corrects the count where the server reports one."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    t0 = time.perf_counter()
    res = Result(False, 0, t0, wanted=n)
    usage = None
    try:
        async with client.post("v1/completions", json=body) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.read()).decode(errors="replace")[:300]
                return res
            async for chunk in sse_events(r):
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "")
                    return res
                now = time.perf_counter() - t0
                for c in chunk.get("choices", []):
                    k = len(c.get("token_ids") or []) or (1 if c.get("text") else 0)
                    if k and not res.token_times:
                        res.ttft_s = now
                    res.token_times.extend([now] * k)
                    res.output_tokens += k
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("keyacc"):
                    res.segments = chunk["keyacc"]["segments"]
        res.e2e_s = time.perf_counter() - t0
        if usage and usage.get("completion_tokens") is not None:
            res.output_tokens = int(usage["completion_tokens"])
        res.ok = res.output_tokens == n
        if not res.ok:
            res.error = f"{res.output_tokens} of {n} tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = repr(e)
    return res


def _progress_bar(desc: str, total: float | None):
    """A tqdm bar on a terminal, nothing otherwise (logs stay clean)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return None
    return tqdm(total=total, desc=desc, unit="req", leave=False, disable=None, dynamic_ncols=True)


HEADERS: dict = {}  # e.g. {"Authorization": "Bearer ..."}, set by the CLI
_RUNS = itertools.count()  # this process's runs so far: a run named by nothing gets the next number


def prompt_rng(wl: Workload, stream: str | None = None) -> random.Random:
    """The random source of one run's prompts: `wl.seed` and the run's name (`stream`, e.g. the
    policy and level; reproducible whatever ran before), or, unnamed, its place among this
    process's runs. Two runs never draw the same prompts (unless named alike)."""
    return random.Random(f"{wl.seed}/{next(_RUNS) if stream is None else stream}")


def _client(url: str, n: int) -> aiohttp.ClientSession:
    # a base URL may carry a path prefix: it ends with "/", request paths are relative to it
    return aiohttp.ClientSession(base_url=url.rstrip("/") + "/", headers=HEADERS,
                                 timeout=aiohttp.ClientTimeout(total=300),
                                 connector=aiohttp.TCPConnector(limit=n), read_bufsize=1 << 16)


async def closed_loop(url: str, model: str, concurrency: int, duration_s: float, wl: Workload,
                      extra: dict | None = None, progress=None, desc: str = "",
                      stream: str | None = None) -> tuple[list[Result], float]:
    rng = prompt_rng(wl, stream)
    results: list[Result] = []
    deadline = time.perf_counter() + duration_s
    bar = _progress_bar(desc or f"c={concurrency}", None)
    async with _client(url, concurrency + 4) as client:

        async def worker():
            while time.perf_counter() < deadline:
                prompt, n = wl.sample(rng)
                results.append(await one_request(client, model, prompt, n, extra))
                if bar is not None:
                    bar.update(1)
                if progress:
                    progress(len(results))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if bar is not None:
            bar.close()
        return results, time.perf_counter() - t0


def poisson_arrivals(rate_per_s: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate_per_s` over `duration_s`."""
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return out
        out.append(t)


async def open_loop(url: str, model: str, rate_per_s: float, duration_s: float, wl: Workload,
                    extra: dict | None = None, desc: str = "", stream: str | None = None) -> tuple[list[Result], float]:
    """Requests arrive at Poisson times regardless of completions; returns when all are done.
    The wall time is from the first arrival to the last completion."""
    rng = prompt_rng(wl, stream)
    arrivals = poisson_arrivals(rate_per_s, duration_s, wl.seed)
    bar = _progress_bar(desc or f"rate={rate_per_s}/s", len(arrivals))
    results: list[Result] = []
    async with _client(url, 256) as client:
        t0 = time.perf_counter()

        async def fire(at: float, prompt: list[int], n: int):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            results.append(await one_request(client, model, prompt, n, extra))
            if bar is not None:
                bar.update(1)

        await asyncio.gather(*(fire(at, *wl.sample(rng)) for at in arrivals))
        if bar is not None:
            bar.close()
        return results, time.perf_counter() - t0


def append_results(path, run: str, results: list[Result]) -> None:
    """A run's requests as JSON lines (`{"run": run, ...Result's fields}`), appended to `path`:
    scripts/bench.py --requests, simulate.py --requests-out; scripts/requests_report.py reads them."""
    with open(path, "a") as f:
        for r in results:
            f.write(json.dumps({"run": run, **dataclasses.asdict(r)}) + "\n")


def pct(xs: list[float], p: float) -> float:
    """Percentile by linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = p / 100 * (len(xs) - 1)
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], wall_s: float, ttft_slo_s: float, tpot_slo_s: float,
              window: tuple[float, float] | None = None) -> dict:
    """Per-run figures. With `window` = (start, end), seconds after the first request started,
    only the steady state counts: tokens that arrived and requests that completed inside it,
    per second of it, and the latencies of requests that started inside it (a closed loop
    opens with every client sending at once, and ends with a tail of fewer clients)."""
    done = list(results)
    tokens = 0.0
    if window is not None and results:
        t0 = min(r.start_s for r in results)
        lo, hi = t0 + window[0], t0 + window[1]
        wall_s = window[1] - window[0]
        in_window = [r for r in results if lo <= r.start_s < hi]
        # a server that sends no token ids: each text chunk stands for its share of the usage count
        tokens = sum(r.output_tokens / len(r.token_times) for r in results if r.ok and r.token_times
                     for t in r.token_times if lo <= r.start_s + t < hi)
        done = [r for r in results if lo <= r.start_s + r.e2e_s < hi]
        results = in_window
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:]) if b > a]
    if window is None:
        tokens = sum(r.output_tokens for r in ok)
    ok_done = [r for r in done if r.ok]
    pool_tokens: dict[str, int] = {}
    moves = 0
    for r in ok:
        moves += sum(1 for a, b in zip(r.segments, r.segments[1:]) if a["pool"] != b["pool"])
        for s in r.segments:
            pool_tokens[s["pool"]] = pool_tokens.get(s["pool"], 0) + s["tokens"]
    good = [r for r in ok_done if r.ttft_s <= ttft_slo_s and (r.tpot_s or 0) <= tpot_slo_s]
    total_pool = sum(pool_tokens.values()) or 1
    # where TTFT went, from the server's trace (its ingress's clock, from the request's start there):
    # when the first hop's replica took the request, when its first token reached the ingress
    firsts = [r.segments[0] for r in ok if r.segments and "first_token_ms" in r.segments[0]]
    path = {"hop_start_p50_ms": round(pct([s["start_ms"] for s in firsts], 50), 1),
            "ingress_ttft_p50_ms": round(pct([s["first_token_ms"] for s in firsts], 50), 1)} if firsts else {}
    return {**path,
        "requests": len(results), "failed": len(results) - len(ok),
        "req_per_s": round(len(ok_done) / wall_s, 3), "output_tok_per_s": round(tokens / wall_s, 1),
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
