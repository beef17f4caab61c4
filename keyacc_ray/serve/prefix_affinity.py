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

STRIDE = 4  # blocks between anchors past the first few
MAX_BLOCKS = 1024  # heads deeper than this many blocks are not keyed (the hashing's cost stays bounded)
PREFIX_BLOCK = 16  # tokens a block of the router's keys (PoolPrefixes): the pools' default block size
PREFIX_TTL_S = 120.0  # how long the router trusts that a pool still caches a head it sent there


def anchor_depths(num_tokens: int, block_size: int) -> list[int]:
    """The depths (in blocks) of a prompt's anchors, deepest first: heads of 1, 2, 4, 8, 12, ...
    full blocks and all its full blocks (the block of the prompt's last token is never a cached
    one: not counted), up to MAX_BLOCKS."""
    n = min((num_tokens - 1) // block_size, MAX_BLOCKS)
    if n <= 0:
        return []
    return sorted({d for d in (1, 2) if d < n} | set(range(STRIDE, n, STRIDE)) | {n}, reverse=True)


def anchors(token_ids: list[int], block_size: int) -> list[bytes]:
    """Keys of the prompt's heads at `anchor_depths`, deepest first."""
    depths = anchor_depths(len(token_ids), block_size)
    if not depths:
        return []
    keys = chain_hashes([], token_ids[:depths[0] * block_size], block_size)
    return [keys[d - 1] for d in depths]


class PoolPrefixes:
    """Which pools (the router's hops) likely cache a prompt's head, predicted, as PrefixAffinity
    does between one pool's replicas, from where prompts ran: every hop a request ran on computed
    or imported its prompt and keeps its blocks cached (Router._ran). An entry older than `ttl_s`
    is not trusted (a cache evicts under load); a hop whose replica failed, stalled or left the
    monitor's view is forgotten. About 400 bytes a key: 32,768 keys are some 13 MB.
    Keys: `anchors(prompt, PREFIX_BLOCK)`, carried by the request's Ticket."""

    def __init__(self, ttl_s: float = PREFIX_TTL_S, max_entries: int = 32_768, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        # key -> hop -> (when, the hop's epoch then), least recently used first
        self._seen: OrderedDict[bytes, dict[str, tuple[float, int]]] = OrderedDict()
        self._epoch: dict[str, int] = {}  # per hop: entries of an older epoch were forgotten

    def cached_tokens(self, keys, num_prompt_tokens: int, hop: str) -> int:
        """Prompt tokens at the head that `hop` likely caches (0: none known)."""
        if not keys:
            return 0
        now, seen, epoch = self.clock(), self._seen, self._epoch.get(hop, 0)
        for key, depth in zip(keys, anchor_depths(num_prompt_tokens, PREFIX_BLOCK)):
            entry = seen.get(key, {}).get(hop)
            if entry is not None and entry[1] == epoch and now - entry[0] <= self.ttl_s:
                return depth * PREFIX_BLOCK
        return 0

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
