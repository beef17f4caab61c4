"""The bytes of the KV tiers below the device pool (engine/tiers.py plans which blocks go where):
host buffers (pinned where the pool is on CUDA), a bounded file on disk and the node's shared
tier (node_tier.py), and the copies of a step's plan between them and the block pool.

A block is, per layer, K [kv_heads, block_size, k_dim] and V [kv_heads, block_size, v_dim], in
the pool's dtype; on disk and in the node's tier one row of bytes per block (every layer's K,
then every layer's V).
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch

from keyacc_ray.engine.tiers import DEVICE, LowerTiers, Move, batches


class KVStore:
    def __init__(self, cache, tiers: LowerTiers, disk_dir: str | None = None):
        """`cache`: the runner's PagedKVCache (lists `k`, `v` of [blocks, heads, block_size, dim])."""
        self.cache = cache
        self.tiers = tiers
        self.device = cache.k[0].device
        self.shapes = [t.shape[1:] for t in cache.k] + [t.shape[1:] for t in cache.v]
        self.dtype = cache.k[0].dtype
        item = torch.finfo(self.dtype).bits // 8
        self.part_bytes = [int(np.prod(s)) * item for s in self.shapes]
        self.block_bytes = sum(self.part_bytes)
        names = [t.name for t in tiers.tiers]
        self.host = None
        if "host" in names:
            n = tiers.tier("host").num_slots
            pin = self.device.type == "cuda"
            self.host = [torch.empty((n, *s), dtype=self.dtype, pin_memory=pin) for s in self.shapes]
        self._node_reads, self._node_writes = [], []  # (a step's: LowerTiers.take_node_side)
        self.disk = None
        self.disk_dir = None
        if "disk" in names:
            n = tiers.tier("disk").num_slots
            self.disk_dir = disk_dir or tempfile.gettempdir()
            os.makedirs(self.disk_dir, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="keyacc-kv-", suffix=".bin", dir=self.disk_dir)
            os.close(fd)
            try:
                self.disk = np.memmap(path, dtype=np.uint8, mode="w+", shape=(n, self.block_bytes))
            finally:
                os.unlink(path)  # mapped, the file lives on with no name: nothing left behind, even on a kill

    # ---- the parts of blocks -----------------------------------------------------------------
    def _pool(self) -> list[torch.Tensor]:
        return list(self.cache.k) + list(self.cache.v)

    def _read(self, kind: str, idx: list[int]) -> list[torch.Tensor]:
        """Per part, [n, ...] tensors of the blocks `idx` of a tier (on the CPU for host and disk)."""
        if kind == DEVICE:
            i = torch.tensor(idx, device=self.device)
            return [p[i] for p in self._pool()]
        if kind == "host":
            i = torch.tensor(idx)
            return [p[i] for p in self.host]
        if kind == "node":
            rows = torch.from_numpy(np.stack([self._node_read(i) for i in idx]))
        else:
            rows = torch.from_numpy(np.ascontiguousarray(self.disk[np.asarray(idx)]))
        out, at = [], 0
        for s, nb in zip(self.shapes, self.part_bytes):
            out.append(rows[:, at:at + nb].contiguous().view(self.dtype).view(len(idx), *s))
            at += nb
        return out

    def _write(self, kind: str, idx: list[int], parts: list[torch.Tensor]) -> None:
        if kind == DEVICE:
            i = torch.tensor(idx, device=self.device)
            for p, x in zip(self._pool(), parts):
                p[i] = x.to(self.device, non_blocking=True)
        elif kind == "host":
            i = torch.tensor(idx)
            for p, x in zip(self.host, parts):
                p[i] = x.to("cpu")
        else:
            rows = torch.cat([x.to("cpu").reshape(len(idx), -1).view(torch.uint8) for x in parts], dim=1).numpy()
            if kind == "node":
                for i, row in zip(idx, rows):  # (written to files by the tier's thread, behind the step)
                    self.tiers.node.put_async(self._node_writes[i], row)
            else:
                self.disk[np.asarray(idx)] = rows

    def _node_read(self, i: int) -> np.ndarray:
        fd, self._node_reads[i] = self._node_reads[i], None
        return self.tiers.node.read(fd)

    def run(self, moves: list[Move]) -> None:
        """The step's copies, batched as their order allows (tiers.batches)."""
        self._node_reads, self._node_writes = self.tiers.take_node_side()
        try:
            self._run(moves)
        finally:
            self.tiers.close_node_reads(self._node_reads)  # (opened for admissions that did not happen)

    def _run(self, moves: list[Move]) -> None:
        for batch in batches(moves):
            t0 = time.perf_counter()
            self._write(batch[0].dst, [m.dst_index for m in batch],
                        self._read(batch[0].src, [m.src_index for m in batch]))
            if batch[0].dst == DEVICE:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.tiers.measured(batch[0].src, len(batch) * self.block_bytes, time.perf_counter() - t0)
