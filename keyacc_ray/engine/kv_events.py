"""Where an engine holds the prefix blocks the router keys prompts by, as changes (vLLM's KV
events: BlockStored / BlockRemoved with their medium). No torch, no Ray.

The router keys a prompt's head by the engines' own chain hashes (blocks.chain_hashes) at a few
depths, its anchors (serve/prefix_affinity.py): the heads of 1 and 2 blocks of ANCHOR_BLOCK
tokens, then of every STRIDE-th block. An engine whose block size is ANCHOR_BLOCK tells it, for
the blocks at those depths, which of its tiers holds each now: its device block pool
("device"), its host or disk tier ("host", "disk"), or none (""). The hooks only mark a key as
changed (the engine's thread, a deque append); `drain()` (the replica's report thread) reads
where each marked key is at that moment and returns what differs from what it told last, so a
change the drain races with is read again at the next one. Blocks at other depths are not told:
the router's answer is a head to within STRIDE blocks, as its own guesses are.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

ANCHOR_BLOCK = 16  # tokens a block of the router's keys: the pools' default block size
STRIDE = 4  # blocks between anchors past the first two
MAX_BLOCKS = 1024  # heads deeper than this many blocks are not keyed (the hashing's cost stays bounded)
GONE = ""


def is_anchor_depth(depth: int) -> bool:
    """A head of `depth` blocks is one the router may key a prompt by (besides a prompt's own
    full depth, which is not told)."""
    return 0 < depth <= MAX_BLOCKS and (depth <= 2 or depth % STRIDE == 0)


class KVEvents:
    def __init__(self, where: Callable[[bytes], str]):
        """`where(key)`: the tier holding the block keyed `key` now ("device", "host", "disk", or
        GONE)."""
        self.where = where
        self._marked: deque = deque()  # a key stored at an anchor depth, or (key,): a key that moved
        self._told: dict[bytes, str] = {}  # key -> the tier last told (never GONE)
        self._all = False  # every told key to be read again (the prefix cache was reset)
        self._resend = False  # every key still held to be told again (resync)

    def stored(self, key: bytes, depth: int) -> None:
        """The engine keyed a block at `depth` of its sequence's chain (it is in the device pool)."""
        if is_anchor_depth(depth):
            self._marked.append(key)

    def moved(self, key: bytes) -> None:
        """A cached block left a place (pushed down a tier, or dropped)."""
        self._marked.append((key,))

    def reset(self) -> None:
        self._all = True

    def resync(self) -> None:
        """Everything told and still held is to be told again at the next drain (the receiver
        lost what it was told: a monitor that restarted)."""
        self._resend = True

    def drain(self) -> list[tuple[bytes, str]]:
        """(key, tier) for every told-or-new anchor key whose tier changed since the last drain
        (after a resync, every key still held too)."""
        out, told, where, marked = [], self._told, self.where, self._marked
        keys: dict[bytes, None] = {}
        resend, self._resend = self._resend, False
        if self._all or resend:
            self._all = False
            keys.update(dict.fromkeys(told))
        while marked:
            m = marked.popleft()
            if isinstance(m, tuple):  # a move: only keys told before matter
                if m[0] in told:
                    keys[m[0]] = None
            else:
                keys[m] = None
        for key in keys:
            now = where(key)
            was = told.get(key, GONE)
            if was == now and not (resend and now != GONE):
                continue
            out.append((key, now))
            if now == GONE:
                told.pop(key, None)
            else:
                told[key] = now
        return out


def attach(blocks, tiers=None) -> KVEvents:
    """Events of an engine's block pool (blocks.BlockManager) and its own lower tiers
    (tiers.LowerTiers, or None): their hooks wired, `where` reading them."""
    cached = blocks._block_of

    def where(key: bytes) -> str:
        if key in cached:
            return "device"
        return tiers.holding(key) if tiers is not None else GONE

    events = KVEvents(where)
    blocks.events = events
    if tiers is not None:
        tiers.events = events
    return events

