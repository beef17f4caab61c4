"""Decode steps at fixed batch sizes over static input buffers; CUDA graphs of them (issue #21).

A decode step of n rows runs at the smallest bucket size B >= n (1, 2, 4, ... up to the engine's
`max_num_seqs`, as vLLM captures them). Its inputs live in buffers allocated once: token ids,
positions, the block each new key goes to and each row's context length (one [4, max_rows] int64
buffer), and the rows' block tables ([max_rows, width] int32, width = the most blocks a sequence
can hold). Rows n..B-1 are padding: token 0 at position 0, its key written into the runner's pad
block (a block the block manager never hands out), attending over that one key; their logits are
dropped. On CUDA each bucket's step is captured once as a CUDA graph and replayed with the buffers
refilled (one host-to-device copy of the small buffer and one of the bucket's table rows, from
pinned memory); on CPU the same step runs eagerly over the same buffers, which is how its
buffer and padding logic is tested on a machine without a GPU.

On CUDA the host side is two sets of pinned buffers used in turn, each with an event recorded
after its copies: with asynchronous scheduling (the engine's `async_scheduling`) step n+1 is
filled while step n may not have been copied yet, so a set is written only once its last copy
is done. Such a step takes its token ids from step n's sampled ids on the device (`fill(...,
prev=)`): the host writes which of them each row takes, gathered on the device after the copy.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two below `max_rows`, then `max_rows` itself."""
    sizes = [1 << i for i in range(max(1, max_rows).bit_length()) if 1 << i < max_rows]
    return sizes + [max_rows]


class StaticDecode:
    """The static buffers, the bucket sizes and (CUDA) the captured graphs of a runner's decode step.

    `step(ids, pos, blk, off, tables, ctx)` is the runner's forward over views of the buffers cut to
    a bucket's rows; it returns their logits [rows, vocab]."""

    def __init__(self, max_rows: int, width: int, block_size: int, pad_block: int, device: torch.device,
                 step: Callable[..., torch.Tensor], staged: bool | None = None):
        """`staged`: host buffers copied into device buffers, two sets in turn (None: on CUDA; on
        CPU the step reads one set of host buffers, unless a test asks for CUDA's arrangement)."""
        self.sizes = bucket_sizes(max_rows)
        self.block_size = block_size
        self.pad_block = pad_block
        self.device = device
        self._step = step
        pin = device.type == "cuda"
        staged = pin if staged is None else staged
        # host buffers: one set on CPU (the step reads them), two used in turn where staged
        self._sets = [(torch.zeros((4, max_rows), dtype=torch.int64, pin_memory=pin),
                       torch.full((max_rows, width), pad_block, dtype=torch.int32, pin_memory=pin))
                      for _ in range(2 if staged else 1)]
        self._copied: list = [None] * len(self._sets)  # per set: an event after its last copies
        self._k = -1
        for _ in self._sets:
            self._next_set()
            self._pad(0, max_rows)
        if not staged:  # the step reads the host buffers themselves
            self.small, self.tables = self.host_small, self.host_tables
        else:
            self.small = torch.empty_like(self.host_small, device=device).copy_(self.host_small)
            self.tables = torch.empty_like(self.host_tables, device=device).copy_(self.host_tables)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self.failure = ""  # why no graph was captured, if none was

    def _next_set(self) -> None:
        """The next set of host buffers, once the copies out of it are done."""
        self._k = (self._k + 1) % len(self._sets)
        self.host_small, self.host_tables = self._sets[self._k]
        self._hs, self._ht = self.host_small.numpy(), self.host_tables.numpy()
        if self._copied[self._k] is not None:
            self._copied[self._k].synchronize()

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int | None:
        """The bucket a step of n rows runs at (None: more rows than any bucket)."""
        if n > self.max_rows:
            return None
        return next(s for s in self.sizes if s >= n)

    def _pad(self, lo: int, hi: int) -> None:
        h = self._hs
        h[0, lo:hi] = 0  # token id
        h[1, lo:hi] = 0  # position
        h[2, lo:hi] = self.pad_block  # the block its key goes to
        h[3, lo:hi] = 1  # keys it attends over: its own
        self._ht[lo:hi, 0] = self.pad_block

    def fill(self, ids: np.ndarray, pos: np.ndarray, rows: np.ndarray, block_array: np.ndarray,
             prev: torch.Tensor | None = None) -> int:
        """Write a step's rows (token ids, positions, rows of the block manager's array) into the
        buffers, pad up to the bucket, send them to the device; returns the bucket. `prev`: the
        previous step's sampled ids on the device; then `ids` says which of them each row takes."""
        n = len(ids)
        b = self.bucket(n)
        bs = self.block_size
        if len(self._sets) > 1:
            self._next_set()
        h = self._hs
        h[0, :n] = ids
        h[1, :n] = pos
        width = int(pos.max()) // bs + 1  # the columns this step reads
        tab = block_array[rows, :width]
        h[2, :n] = tab[np.arange(n), pos // bs]
        h[3, :n] = pos + 1
        self._ht[:n, :width] = tab
        self._pad(n, b)
        if self.small is not self.host_small:
            self.small.copy_(self.host_small, non_blocking=True)
            self.tables[:b].copy_(self.host_tables[:b], non_blocking=True)  # whole rows: one contiguous copy
            if self.device.type == "cuda":
                ev = self._copied[self._k] = self._copied[self._k] or torch.cuda.Event()
                ev.record()
        if prev is not None:  # (after the copy, on the same stream: the rows' sources are there)
            self.small[0, :n].copy_(prev.index_select(0, self.small[0, :n]))
        return b

    def _run_step(self, b: int) -> torch.Tensor:
        s = self.small
        pos = s[1, :b]
        return self._step(s[0, :b], pos, s[2, :b], pos % self.block_size, self.tables[:b], s[3, :b])

    def run(self, b: int) -> torch.Tensor:
        """The step at bucket b over what `fill` wrote: the graph's replay where captured. The logits
        [b, vocab] are the graph's own output buffer: read them before the next step."""
        g = self.graphs.get(b)
        if g is None:
            return self._run_step(b)
        g.replay()
        return self.outputs[b]

    def capture(self) -> bool:
        """CUDA: a graph per bucket, largest first, sharing one memory pool (each warmed up once
        eagerly first). A model whose forward cannot be captured (a host sync, a data-dependent
        shape) keeps the eager step, logged."""
        if self.device.type != "cuda":
            return False
        t0 = time.perf_counter()
        pool = None
        self._pad(0, self.max_rows)
        self.small.copy_(self.host_small)
        self.tables.copy_(self.host_tables)
        try:
            for b in reversed(self.sizes):
                self._run_step(b)  # warm-up: kernels compiled and tuned outside the capture
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool):
                    out = self._run_step(b)
                pool = g.pool()
                self.graphs[b], self.outputs[b] = g, out
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - whatever the model does that a graph cannot hold
            self.graphs.clear()
            self.outputs.clear()
            self.failure = f"{type(e).__name__}: {e}"
            log.warning("decode step not captured as CUDA graphs (%s); eager decode", self.failure)
            return False
        self.capture_s = time.perf_counter() - t0
        log.info("decode step captured as CUDA graphs at batch sizes %s in %.1f s", self.sizes, self.capture_s)
        return True
