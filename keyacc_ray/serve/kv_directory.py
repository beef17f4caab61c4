"""Where a hand-off's KV reference waits between two pools.

A pool puts a sequence's K/V arrays into the object store and leaves the reference here under a
key; the hand-off that travels through the ingress carries only the key (so token streams can
use Serve's gRPC transport, which pickles: a pickled ObjectRef would pin its object for the
owner's lifetime). The next pool takes the reference by key: Ray counts this actor, then that
pool, as borrowers, so the object lives exactly as long as someone holds it. An entry nobody
takes (the request was cancelled between hops) expires after `ttl_s`. If this actor restarts,
its entries are gone and the next pool prefills again (the hand-off carries the tokens).

Plain asyncio; the pools wrap it with `ray.remote` (one named, detached instance).
"""
from __future__ import annotations

import asyncio
import time

from keyacc_ray.serve.aio import wait_at_most

NAME = "keyacc_kv_directory"


class KVDirectory:
    def __init__(self, ttl_s: float = 60.0, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._refs: dict[str, tuple[list, float]] = {}
        self._waiting: dict[str, asyncio.Event] = {}
        self.puts = 0  # hand-offs that carried KV, since this actor started

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, (_, t) in self._refs.items() if now - t > self.ttl_s]:
            del self._refs[key]

    async def put(self, key: str, refs: list) -> None:
        self._expire()
        self._refs[key] = (refs, self.clock())
        self.puts += 1
        ev = self._waiting.pop(key, None)
        if ev is not None:
            ev.set()

    async def take(self, key: str, timeout_s: float) -> list:
        """The references left under `key` (removed from here), waiting up to `timeout_s` for
        them to arrive (the put and the take race); [] if they never do."""
        if key not in self._refs:
            ev = self._waiting.setdefault(key, asyncio.Event())
            try:
                await wait_at_most(ev.wait(), timeout_s)
            except asyncio.TimeoutError:
                self._waiting.pop(key, None)
                return []
        entry = self._refs.pop(key, None)
        return entry[0] if entry is not None else []

    async def size(self) -> int:
        self._expire()
        return len(self._refs)

    async def num_puts(self) -> int:
        return self.puts
