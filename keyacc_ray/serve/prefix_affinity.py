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

from collections import OrderedDict

from keyacc_ray.engine.blocks import chain_hashes

STRIDE = 4  # blocks between anchors past the first few


def anchors(token_ids: list[int], block_size: int) -> list[bytes]:
    """Keys of the prompt's heads of 1, 2, 4, 8, 12, ... full blocks and of all its full blocks,
    deepest first (the block of the prompt's last token is never a cached one: not counted)."""
    n = (len(token_ids) - 1) // block_size
    if n <= 0:
        return []
    keys = chain_hashes([], token_ids[:n * block_size], block_size)
    depths = sorted({d for d in (1, 2) if d < n} | set(range(STRIDE, n, STRIDE)) | {n}, reverse=True)
    return [keys[d - 1] for d in depths]


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
