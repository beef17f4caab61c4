"""KV block accounting and the prefix cache. No torch: a replica's KV budget is a number of
fixed-size token blocks, and the tables kept here are the physical pool's.

Two ways to spend it (`EngineConfig.kv_allocation`, see scheduler.py): "reserve" takes blocks for
the prompt plus every token a sequence may generate at admission, so it never runs out
mid-decode; "lazy" (vLLM's way) takes blocks as the sequence grows (`grow`), and the scheduler
preempts the newest sequence when they run out. Running out is a `False`, never an error.

Prefix caching (vLLM's automatic prefix caching): a block whose tokens are all computed is keyed
by a hash of its tokens chained with the hash of the block before it (so a key names the whole
prefix up to the block's end). A new sequence whose leading full blocks are keyed here shares
them (reference counts) and prefills only the rest. A block nobody holds keeps its key and KV
until its memory is needed: free blocks without a key are handed out first, then keyed ones,
least recently freed first (a sequence's tail before its head). Keyed blocks are full and never
written again, so sharing them needs no copy.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import numpy as np


def chain_hashes(hashes: list[bytes], token_ids: list[int], block_size: int) -> list[bytes]:
    """Extend `hashes` (the keys of the first len(hashes) blocks of `token_ids`) with the keys of
    every further full block; returns it. A key: 16 bytes of BLAKE2b over the parent's key and the
    block's token ids (a cryptographic hash: no crafted prompt collides with another's)."""
    start, end = len(hashes), len(token_ids) // block_size
    if end <= start:
        return hashes
    raw = memoryview(array("q", token_ids[start * block_size:end * block_size]).tobytes())
    step, key, blake2b = 8 * block_size, hashes[-1] if hashes else b"", hashlib.blake2b
    for at in range(0, (end - start) * step, step):
        h = blake2b(key, digest_size=16)
        h.update(raw[at:at + step])
        key = h.digest()
        hashes.append(key)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int = 0, max_blocks_per_seq: int = 0,
                 prefix_caching: bool = False):
        """`max_seqs` x `max_blocks_per_seq` > 0: the tables are mirrored into one int32 array
        (`array`, a row per sequence, `row[seq_id]`), from which a step's block tables are one
        gather instead of a Python loop over its rows (vLLM's persistent block table)."""
        assert num_blocks > 0 and block_size > 0, f"bad block budget {num_blocks=} {block_size=}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # free blocks without a key
        self._ref = [0] * num_blocks  # how many tables hold each block
        self._key_of: dict[int, bytes] = {}  # keyed blocks -> their key
        self._block_of: dict[bytes, int] = {}  # key -> its block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed blocks nobody holds, LRU first
        self._num_keyed: dict[str, int] = {}  # sequence id -> its leading blocks registered (or shared)
        self.on_evict = None  # called (key, block) when a cached block's memory is taken (tiers.py)
        self.events = None  # kv_events.KVEvents: what the router is told of the keys held here
        # counters (tokens, as vLLM's prefix_cache_queries / prefix_cache_hits; blocks evicted)
        self.queries = self.hits = self.evictions = 0
        self.tables: dict[str, list[int]] = {}  # sequence id -> its blocks, in order (read, never change)
        mirrored = max_seqs > 0 and max_blocks_per_seq > 0
        self.array = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int32) if mirrored else None
        self.row: dict[str, int] = {}  # sequence id -> its row of `array` (a table too wide has none)
        self.row_changes = 0  # how often `row` has changed (a row given or taken back)
        self._free_rows: list[int] = list(range(max_seqs - 1, -1, -1)) if mirrored else []

    def _mirror(self, seq_id: str, start: int) -> None:
        """Copy the table's blocks from `start` on into its row of the array (a row on first use)."""
        if self.array is None:
            return
        table = self.tables[seq_id]
        r = self.row.get(seq_id)
        if r is None:
            if not self._free_rows or len(table) > self.array.shape[1]:
                return
            r = self.row[seq_id] = self._free_rows.pop()
            self.row_changes += 1
            start = 0
        elif len(table) > self.array.shape[1]:  # (a longer sequence than the engine serves: no row)
            self._free_rows.append(self.row.pop(seq_id))
            self.row_changes += 1
            return
        self.array[r, start:len(table)] = table[start:]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix-cache key (in use or not)."""
        return len(self._key_of)

    def can_ever_allocate(self, num_tokens: int) -> bool:
        """Whether `num_tokens` fit this budget at all (with every block free)."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def _take(self) -> int:
        """A block to write: a free one, else the least recently freed cached one (its key dropped)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(b)
            del self._block_of[key]
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(key, b)
            if self.events is not None:
                self.events.moved(key)
        self._ref[b] = 1
        return b

    # ---- the prefix cache ------------------------------------------------------------------
    def cached_prefix(self, hashes: list[bytes], max_blocks: int) -> int:
        """How many of the leading blocks keyed by `hashes` (at most `max_blocks`) are cached."""
        n, cached = 0, self._block_of
        for h in hashes[:max_blocks]:
            if h not in cached:
                break
            n += 1
        return n

    def register(self, seq_id: str, hashes: list[bytes], num_full: int) -> None:
        """The sequence's first `num_full` blocks are computed (`hashes` keys them): key those not
        keyed yet, so that later sequences share them. A block whose key another block already
        has (two sequences computed the same prefix at once) stays unkeyed, freed as usual."""
        done = self._num_keyed.get(seq_id, 0)
        if num_full <= done or seq_id not in self.tables:
            return
        table, events = self.tables[seq_id], self.events
        for i in range(done, num_full):
            h = hashes[i]
            if h not in self._block_of:
                self._block_of[h] = table[i]
                self._key_of[table[i]] = h
                if events is not None:
                    events.stored(h, i + 1)
        self._num_keyed[seq_id] = num_full

    # ---- tables ----------------------------------------------------------------------------
    def blocks_taken(self, num_tokens: int, shared: list[bytes] = ()) -> int:
        """Free blocks `allocate(.., num_tokens, shared)` would take (a shared cached block
        nobody holds counts: it leaves the free ones)."""
        hit = [self._block_of[h] for h in shared]
        return self.blocks_for(num_tokens) - len(hit) + sum(1 for b in hit if self._ref[b] == 0)

    def allocate(self, seq_id: str, num_tokens: int, shared: list[bytes] = ()) -> bool:
        """Blocks for `num_tokens`: the cached blocks keyed by `shared` (checked cached by
        `cached_prefix` just before), then new ones; False (and nothing changed) if they do not fit."""
        assert seq_id not in self.tables, f"{seq_id} already holds blocks"
        if self.blocks_taken(num_tokens, shared) > self.num_free_blocks:
            return False
        hit = [self._block_of[h] for h in shared]
        n = self.blocks_for(num_tokens) - len(hit)
        for b in hit:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        self.tables[seq_id] = hit + [self._take() for _ in range(n)]
        if hit:
            self._num_keyed[seq_id] = len(hit)
        self._mirror(seq_id, 0)
        return True

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Extend a sequence's blocks to hold `num_tokens`; False (nothing changed) if the free
        blocks do not suffice."""
        table = self.tables[seq_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free_blocks:
            return False
        if need > 0:
            start = len(table)
            table.extend(self._take() for _ in range(need))
            self._mirror(seq_id, start)
        return True

    def free(self, seq_id: str) -> None:
        """Give the sequence's blocks back; a cached one nobody holds now keeps its KV and key
        until its memory is needed (tail blocks go first)."""
        ref, keyed = self._ref, self._key_of
        for b in reversed(self.tables.pop(seq_id, [])):
            ref[b] -= 1
            if ref[b] == 0:
                if b in keyed:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        self._num_keyed.pop(seq_id, None)
        r = self.row.pop(seq_id, None)
        if r is not None:
            self._free_rows.append(r)
            self.row_changes += 1

    def reset_prefix_cache(self) -> int:
        """Drop every key (vLLM's reset_prefix_cache); blocks in use stay. Returns the keys dropped."""
        n = len(self._key_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        for s in self._num_keyed:
            self._num_keyed[s] = len(self.tables[s])  # nothing of theirs is keyed again
        if self.events is not None:
            self.events.reset()
        return n

    def block_table(self, seq_id: str) -> list[int]:
        return list(self.tables.get(seq_id, []))

    def table_ref(self, seq_id: str) -> list[int]:
        """The sequence's block table itself (not a copy): read it, do not change it."""
        return self.tables[seq_id]
