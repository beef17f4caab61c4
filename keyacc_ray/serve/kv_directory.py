"""Where a hand-off's KV reference waits between two pools.

A pool puts a sequence's K/V arrays into the object store and leaves the reference here under a
key; the hand-off that travels through the ingress carries only the key (so token streams can
use Serve's gRPC transport, which pickles: a pickled ObjectRef would pin its object for the
owner's lifetime). The next pool takes the reference by key: Ray counts this actor, then that
pool, as borrowers, so the object lives exactly as long as someone holds it. An entry nobody
takes (the request was cancelled between hops) expires after `ttl_s`. If this actor restarts,
its entries are gone and the next pool prefills again (the hand-off carries the tokens).

A taken entry stays answerable for `taken_keep_s`: a driver that gave a hop up (its replica did
not answer within the bound) sends the same hand-off to another hop, and the replica it gave up
on may still have taken the KV (a call Serve assigned just as it was cancelled runs to its end;
a busy replica's answer can come after the bound). The second take gets the same references (the
object is immutable: both may read it) instead of prefilling again. The hop given up on, once
cancelled, gives back what it took (`give_back`): that renews the taken entry rather than
putting one that the next hop, which may have taken the key already, would never take (an entry
left until `ttl_s`). The exporting replica holds its own reference for KV_HOLD_S (60 s) after
the export anyway, so this rarely keeps an object longer.

Plain asyncio; the pools wrap it with `ray.remote` (one named, detached instance).
"""
from __future__ import annotations

import asyncio
import time

from keyacc_ray.serve.aio import wait_at_most

NAME = "keyacc_kv_directory"


class KVDirectory:
    def __init__(self, ttl_s: float = 60.0, clock=time.monotonic, taken_keep_s: float = 30.0):
        self.ttl_s = ttl_s
        self.taken_keep_s = taken_keep_s
        self.clock = clock
        self._refs: dict[str, tuple[list, float]] = {}
        self._taken: dict[str, tuple[list, float]] = {}  # taken, kept for a second take of the same key
        self._waiting: dict[str, asyncio.Event] = {}
        self.puts = 0  # hand-offs that carried KV, since this actor started
        self.given_back = 0  # hops that gave back what they took (cancelled before their tokens reached anyone)

    def _expire(self) -> None:
        """Drop entries past their time, oldest first: each dict holds its entries in the order of
        their times (an entry written again is moved to the end), so this stops at the first
        fresh one instead of reading every entry at every call (one per hand-off)."""
        now = self.clock()
        for entries, keep_s in ((self._refs, self.ttl_s), (self._taken, self.taken_keep_s)):
            while entries:
                key, (_, t) = next(iter(entries.items()))
                if now - t <= keep_s:
                    break
                del entries[key]

    async def put(self, key: str, refs: list) -> None:
        self._expire()
        self._refs.pop(key, None)  # (to the end: the order of times)
        self._refs[key] = (refs, self.clock())
        self.puts += 1
        ev = self._waiting.pop(key, None)
        if ev is not None:
            ev.set()

    async def give_back(self, key: str, refs: list) -> None:
        """A hop cancelled after it took `key` (pools' `_give_back`) returns what the driver's next
        hop should get: the references it took, or [] when its tokens began there (the next hop
        then prefills, unless the references its take left answerable are still here). While that
        take's entry is kept, the next take gets it at once anyway, so only its time is renewed:
        put back under the key, it would outlive a next hop that took the key first (the driver
        does not wait for the hop it gave up on), a reference nobody takes until `ttl_s`. Not a
        put (`puts` counts hand-offs)."""
        self._expire()
        self.given_back += 1
        entry = self._taken.pop(key, None)
        if entry is not None:
            self._taken[key] = (entry[0], self.clock())  # (to the end: the order of times)
            return
        self._refs.pop(key, None)
        self._refs[key] = (refs, self.clock())
        ev = self._waiting.pop(key, None)
        if ev is not None:
            ev.set()

    async def take(self, key: str, timeout_s: float) -> list:
        """The references left under `key` (or taken from it within `taken_keep_s`), waiting up
        to `timeout_s` for them to arrive (the put and the take race); [] if they never do."""
        self._expire()
        if key not in self._refs and key not in self._taken:
            ev = self._waiting.setdefault(key, asyncio.Event())
            try:
                await wait_at_most(ev.wait(), timeout_s)
            except asyncio.TimeoutError:
                self._waiting.pop(key, None)
                return []
        entry = self._refs.pop(key, None)
        refs = entry[0] if entry is not None else []
        if not refs and key in self._taken:  # taken before by a hop its driver gave up on (an empty
            refs = self._taken[key][0]       # entry put back: that hop made tokens nobody received)
        if refs:
            self._taken.pop(key, None)  # (to the end: the order of times)
            self._taken[key] = (refs, self.clock())
        return refs

    async def size(self) -> int:
        self._expire()
        return len(self._refs)

    async def num_puts(self) -> int:
        return self.puts

    async def num_given_back(self) -> int:
        return self.given_back
