"""KV block accounting. No torch: a replica's KV budget is a number of fixed-size token blocks.

Two ways to spend it (`EngineConfig.kv_allocation`, see scheduler.py): "reserve" takes blocks for
the prompt plus every token a sequence may generate at admission, so it never runs out
mid-decode; "lazy" (vLLM's way) takes blocks as the sequence grows (`grow`), and the scheduler
preempts the newest sequence when they run out. Running out is a `False`, never an error.
"""
from __future__ import annotations

import numpy as np


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int = 0, max_blocks_per_seq: int = 0):
        """`max_seqs` x `max_blocks_per_seq` > 0: the tables are mirrored into one int32 array
        (`array`, a row per sequence, `row[seq_id]`), from which a step's block tables are one
        gather instead of a Python loop over its rows (vLLM's persistent block table)."""
        assert num_blocks > 0 and block_size > 0, f"bad block budget {num_blocks=} {block_size=}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}  # sequence id -> its blocks, in order (read, never change)
        mirrored = max_seqs > 0 and max_blocks_per_seq > 0
        self.array = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int32) if mirrored else None
        self.row: dict[str, int] = {}  # sequence id -> its row of `array` (a table too wide has none)
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
            start = 0
        elif len(table) > self.array.shape[1]:  # (a longer sequence than the engine serves: no row)
            self._free_rows.append(self.row.pop(seq_id))
            return
        self.array[r, start:len(table)] = table[start:]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_ever_allocate(self, num_tokens: int) -> bool:
        """Whether `num_tokens` fit this budget at all (with every block free)."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Reserve blocks for `num_tokens`; False (and nothing changed) if they do not fit."""
        assert seq_id not in self.tables, f"{seq_id} already holds blocks"
        n = self.blocks_for(num_tokens)
        if n > len(self._free):
            return False
        self.tables[seq_id] = [self._free.pop() for _ in range(n)]
        self._mirror(seq_id, 0)
        return True

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Extend a sequence's blocks to hold `num_tokens`; False (nothing changed) if the free
        blocks do not suffice."""
        table = self.tables[seq_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            return False
        if need > 0:
            start = len(table)
            table.extend(self._free.pop() for _ in range(need))
            self._mirror(seq_id, start)
        return True

    def free(self, seq_id: str) -> None:
        self._free.extend(reversed(self.tables.pop(seq_id, [])))
        r = self.row.pop(seq_id, None)
        if r is not None:
            self._free_rows.append(r)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self.tables.get(seq_id, []))

    def table_ref(self, seq_id: str) -> list[int]:
        """The sequence's block table itself (not a copy): read it, do not change it."""
        return self.tables[seq_id]
