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

The host buffers are refilled by the next step only after the previous step's sampled tokens
came back to the host (the engine's one device-to-host copy per step), so the asynchronous
copies out of them have finished by then.
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
                 step: Callable[..., torch.Tensor]):
        self.sizes = bucket_sizes(max_rows)
        self.block_size = block_size
        self.pad_block = pad_block
        self.device = device
        self._step = step
        pin = device.type == "cuda"
        self.host_small = torch.zeros((4, max_rows), dtype=torch.int64, pin_memory=pin)
        self.host_tables = torch.full((max_rows, width), pad_block, dtype=torch.int32, pin_memory=pin)
        self._hs, self._ht = self.host_small.numpy(), self.host_tables.numpy()
        self._pad(0, max_rows)
        if device.type == "cpu":  # the step reads the host buffers themselves
            self.small, self.tables = self.host_small, self.host_tables
        else:
            self.small = self.host_small.to(device)
            self.tables = self.host_tables.to(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self.failure = ""  # why no graph was captured, if none was

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

    def fill(self, ids: np.ndarray, pos: np.ndarray, rows: np.ndarray, block_array: np.ndarray) -> int:
        """Write a step's rows (token ids, positions, rows of the block manager's array) into the
        buffers, pad up to the bucket, send them to the device; returns the bucket."""
        n = len(ids)
        b = self.bucket(n)
        bs = self.block_size
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
