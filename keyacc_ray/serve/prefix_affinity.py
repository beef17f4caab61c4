"""Prefix affinity between the replicas of one pool (no Ray): send a prompt to the replica that
most recently took a prompt with the longest common head, so that its prefix cache has it.

The router cannot see the replicas' caches; like SGLang's router it predicts them from what it
routed. A prompt's anchors are the engines' own block keys (`blocks.chain_hashes`: a key names the
whole head up to its block) at the heads of 1, 2, 4 blocks of `block_size` tokens, then of every
4th block, and of all its full blocks: a conversation's next turn, which extends the last prompt,
shares the anchors of the last prompt's heads, to within 4 blocks of its end;
routing a prompt records its anchors against the replica it went to (a bounded LRU map). A new
prompt goes to the replica of its deepest known anchor, unless that replica's queue is longer
than the shortest by more than `imbalance` (then the usual power of two choices). Prompts with
no known anchor take the usual way too.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from keyacc_ray.engine.blocks import chain_hashes
from keyacc_ray.engine.kv_events import ANCHOR_BLOCK as PREFIX_BLOCK  # tokens a block of the router's keys
from keyacc_ray.engine.kv_events import MAX_BLOCKS, STRIDE

PREFIX_TTL_S = 120.0  # how long the router trusts that a pool still caches a head it sent there


def anchor_depths(num_tokens: int, block_size: int) -> list[int]:
    """The depths (in blocks) of a prompt's anchors, deepest first: heads of 1, 2, 4, 8, 12, ...
    full blocks and all its full blocks (the block of the prompt's last token is never a cached
    one: not counted), up to MAX_BLOCKS."""
    n = min((num_tokens - 1) // block_size, MAX_BLOCKS)
    if n <= 0:
        return []
    # (the depths below n are those kv_events.is_anchor_depth names: what the engines tell)
    return sorted({d for d in (1, 2) if d < n} | set(range(STRIDE, n, STRIDE)) | {n}, reverse=True)


def anchors(token_ids: list[int], block_size: int) -> list[bytes]:
    """Keys of the prompt's heads at `anchor_depths`, deepest first."""
    depths = anchor_depths(len(token_ids), block_size)
    if not depths:
        return []
    keys = chain_hashes([], token_ids[:depths[0] * block_size], block_size)
    return [keys[d - 1] for d in depths]


TIER_ORDER = {"device": 0, "host": 1, "node": 2, "disk": 3}  # nearest first


class PoolPrefixes:
    """Which pools (the router's hops) cache a prompt's head, and in which tier. Two sources:
    what the engines tell (kv_events.py, through the monitor: `observe`), exact per replica and
    tier; and, until they tell, a guess from where prompts ran, as PrefixAffinity guesses between
    one pool's replicas: every hop a request ran on computed or imported its prompt and keeps its
    blocks cached (Router._ran). A guess older than `ttl_s` is not trusted (a cache evicts under
    load), nor one an engine's news of the key leaving that pool came after; a hop whose replica
    failed, stalled or left the monitor's view is forgotten (its guesses; what a live replica of
    it told stands). About 400 bytes a key: 32,768 keys are some 13 MB.
    Keys: `anchors(prompt, PREFIX_BLOCK)`, carried by the request's Ticket."""

    def __init__(self, ttl_s: float = PREFIX_TTL_S, max_entries: int = 32_768, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        # key -> hop -> (when, the hop's epoch then), least recently used first
        self._seen: OrderedDict[bytes, dict[str, tuple[float, int]]] = OrderedDict()
        self._epoch: dict[str, int] = {}  # per hop: entries of an older epoch were forgotten
        # what engines told: key -> hop -> replica -> tier, least recently told first
        self._told: OrderedDict[bytes, dict[str, dict[str, str]]] = OrderedDict()
        self._live: dict[str, set] = {}  # hop -> its replicas the monitor sees (a gone one's news is void)

    def cached_tokens(self, keys, num_prompt_tokens: int, hop: str) -> int:
        """Prompt tokens at the head that `hop` likely caches, in any tier (0: none known)."""
        return self.cached(keys, num_prompt_tokens, hop)[0]

    def cached(self, keys, num_prompt_tokens: int, hop: str) -> tuple[int, int, str]:
        """(tokens at the head `hop` caches in any tier, of those the head it holds in its
        device pool, the farthest tier the rest was found in: "" when all of it is in the
        pool). A guess counts as the device pool (it just ran there)."""
        if not keys:
            return 0, 0, ""
        now, seen, told, epoch = self.clock(), self._seen, self._told, self._epoch.get(hop, 0)
        live = self._live.get(hop, ())
        total, far = 0, ""
        for key, depth in zip(keys, anchor_depths(num_prompt_tokens, PREFIX_BLOCK)):
            tier = None
            by_replica = told.get(key, {}).get(hop)
            if by_replica:
                tiers = [t for r, t in by_replica.items() if r in live]
                tier = min(tiers, key=TIER_ORDER.__getitem__) if tiers else None
            if tier is None:
                entry = seen.get(key, {}).get(hop)
                if entry is not None and entry[1] == epoch and now - entry[0] <= self.ttl_s:
                    tier = "device"
            if tier is None:
                continue
            total = total or depth * PREFIX_BLOCK
            if tier == "device":
                return total, depth * PREFIX_BLOCK, far
            if not far or TIER_ORDER[tier] > TIER_ORDER[far]:
                far = tier
        return total, 0, far

    def record(self, keys, hop: str) -> None:
        now, seen = self.clock(), self._seen
        entry = (now, self._epoch.get(hop, 0))
        for k in keys:
            hops = seen.get(k)
            if hops is None:
                hops = seen[k] = {}
            else:
                seen.move_to_end(k)
            hops[hop] = entry
        while len(seen) > self.max_entries:
            seen.popitem(last=False)

    def observe(self, hop: str, replica: str, events) -> None:
        """An engine's news (kv_events.KVEvents.drain): (key, tier) each, tier "" when the key
        left every tier of that replica (then the guess that `hop` holds it is dropped too)."""
        told, seen = self._told, self._seen
        for key, tier in events:
            hops = told.get(key)
            if tier:
                if hops is None:
                    hops = told[key] = {}
                else:
                    told.move_to_end(key)
                hops.setdefault(hop, {})[replica] = tier
                continue
            guessed = seen.get(key)
            if guessed is not None:
                guessed.pop(hop, None)
            if hops is not None and hop in hops:
                hops[hop].pop(replica, None)
                if not hops[hop]:
                    del hops[hop]
                    if not hops:
                        del told[key]
        while len(told) > self.max_entries:
            told.popitem(last=False)

    def live(self, hop: str, replicas) -> None:
        """The replicas of `hop` the monitor sees now: news from others is void."""
        self._live[hop] = set(replicas)

    def forget_told(self) -> None:
        """The engines' news is incomplete (the monitor restarted, or its log moved on past this
        router's place in it): guesses only, until they tell again."""
        self._told.clear()

    def forget(self, hop: str) -> None:
        """`hop`'s caches are not to be trusted (a replica of it failed, stalled or left). O(1): a
        new epoch for the hop (the kill soak stalls hops by the hundred a minute; walking every
        key each time cost the router milliseconds apiece)."""
        self._epoch[hop] = self._epoch.get(hop, 0) + 1


class PrefixAffinity:
    def __init__(self, block_size: int = 16, imbalance: int = 4, max_entries: int = 100_000):
        self.block_size = block_size
        self.imbalance = imbalance
        self.max_entries = max_entries
        self._where: OrderedDict[bytes, str] = OrderedDict()  # anchor -> replica id, LRU first

    def preferred(self, keys: list[bytes], queue_lens: dict[str, int | None]) -> str | None:
        """The replica of the deepest known anchor among the candidates (`queue_lens`: replica
        id -> its queue length, None where unknown), if its queue is within `imbalance` of the
        shortest known; else None."""
        known = [q for q in queue_lens.values() if q is not None]
        shortest = min(known) if known else 0
        for k in keys:
            r = self._where.get(k)
            if r is not None and r in queue_lens:
                q = queue_lens[r]
                return r if q is None or q - shortest <= self.imbalance else None
        return None

    def record(self, keys: list[bytes], replica: str) -> None:
        where = self._where
        for k in keys:
            where[k] = replica
            where.move_to_end(k)
        while len(where) > self.max_entries:
            where.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica gone: its anchors point nowhere."""
        for k in [k for k, r in self._where.items() if r == replica]:
            del self._where[k]
