"""Multi-turn chat traffic for any OpenAI-compatible /v1/completions endpoint (plain asyncio +
aiohttp, no Ray): what a prefix cache is for.

Each conversation opens with the same system prompt and goes on for several turns; every turn
sends the whole history (system prompt, each earlier user message and reply, the new user
message) as token ids, streamed, as a chat client re-renders the whole conversation each turn.
All conversations run at once, each turn after the previous reply has arrived. Per turn it
records TTFT, the tokens received and `usage.prompt_tokens_details.cached_tokens`. Prompts are
random token ids, seeded: the same traffic for every server configuration compared.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp

from keyacc_ray.bench.loadgen import pct, sse_events


@dataclass
class ChatWorkload:
    conversations: int = 32
    system_tokens: int = 1500
    min_turns: int = 4
    max_turns: int = 8
    user_tokens: int = 48  # per turn, +-50%
    output_tokens: int = 32  # per reply (ignore_eos)
    vocab_low: int = 10
    vocab_high: int = 2000
    seed: int = 0

    def plan(self) -> tuple[list[int], list[list[list[int]]]]:
        """The system prompt, and per conversation its user messages."""
        rng = random.Random(self.seed)
        system = [rng.randrange(self.vocab_low, self.vocab_high) for _ in range(self.system_tokens)]
        convs = []
        for _ in range(self.conversations):
            turns = rng.randint(self.min_turns, self.max_turns)
            convs.append([[rng.randrange(self.vocab_low, self.vocab_high)
                           for _ in range(max(1, round(self.user_tokens * rng.uniform(0.5, 1.5))))]
                          for _ in range(turns)])
        return system, convs


@dataclass
class Turn:
    conversation: int
    index: int  # 0: the first turn (a cold prefix but for the system prompt)
    prompt_tokens: int
    ok: bool = False
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    error: str = ""


async def _turn(client: aiohttp.ClientSession, model: str, prompt: list[int], n: int, turn: Turn,
                route: str | None = None) -> Turn:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    if route:
        body["keyacc"] = {"route": route}
    t0 = time.perf_counter()
    try:
        async with client.post("v1/completions", json=body) as r:
            if r.status != 200:
                turn.error = f"{r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return turn
            async for chunk in sse_events(r):
                if "error" in chunk:
                    turn.error = chunk["error"].get("message", "")
                    return turn
                for c in chunk.get("choices", []):
                    ids = c.get("token_ids") or []
                    if ids and not turn.output_ids:
                        turn.ttft_s = time.perf_counter() - t0
                    turn.output_ids += ids
                usage = chunk.get("usage")
                if usage:
                    turn.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        turn.e2e_s = time.perf_counter() - t0
        turn.ok = len(turn.output_ids) == n
        if not turn.ok:
            turn.error = f"{len(turn.output_ids)} of {n} tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        turn.error = repr(e)
    return turn


async def run_chat(url: str, model: str, wl: ChatWorkload, timeout_s: float = 600,
                   route=None) -> tuple[list[Turn], float]:
    """Every conversation to its end, all at once; the turns and the wall time (`route`: every
    turn pinned there, the `keyacc` extension; or a function of (conversation, turn) that names
    each turn's route)."""
    system, convs = wl.plan()
    turns: list[Turn] = []
    async with aiohttp.ClientSession(base_url=url.rstrip("/") + "/",
                                     timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=wl.conversations)) as client:
        async def conversation(c: int, messages: list[list[int]]) -> None:
            history = list(system)
            for i, user in enumerate(messages):
                history += user
                where = route(c, i) if callable(route) else route
                t = await _turn(client, model, list(history), wl.output_tokens, Turn(c, i, len(history)), where)
                turns.append(t)
                if not t.ok:
                    return  # the conversation cannot go on without its reply
                history += t.output_ids

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c, m) for c, m in enumerate(convs)))
        return turns, time.perf_counter() - t0


def summarize(turns: list[Turn], wall_s: float) -> dict:
    ok = [t for t in turns if t.ok]
    first = [t.ttft_s for t in ok if t.index == 0]
    later = [t.ttft_s for t in ok if t.index > 0]
    prompt = sum(t.prompt_tokens for t in ok)
    return {
        "turns": len(turns), "failed": len(turns) - len(ok),
        "ttft_first_p50_s": round(pct(first, 50), 4), "ttft_first_p99_s": round(pct(first, 99), 4),
        "ttft_followup_p50_s": round(pct(later, 50), 4), "ttft_followup_p99_s": round(pct(later, 99), 4),
        "output_tokens_per_s": round(sum(len(t.output_ids) for t in ok) / wall_s, 2) if wall_s else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": sum(t.cached_tokens for t in ok),
        "hit_rate": round(sum(t.cached_tokens for t in ok) / prompt, 4) if prompt else 0.0,
        "wall_s": round(wall_s, 2),
    }
