"""A sequence's portable state: the KV hand-off between engines, devices and processes.

A `KVPackage` is numpy arrays plus small metadata, so `ray.put` stores it in shared memory
without pickling tensors and `ray.get` in another process is a zero-copy view. bfloat16 travels
as a uint16 view (numpy has no bf16). `to_engine_tensors` is the explicit "reshape" step: it
converts layout (head-major or token-major), dtype and device to what the importing engine
uses, so decoding continues exactly where it stopped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LAYOUTS = ("LHTD", "LTHD")  # [layers, kv_heads, tokens, head_dim] / [layers, tokens, kv_heads, head_dim]
_WIRE = {torch.float32: (np.float32, None), torch.float16: (np.float16, None),
         torch.bfloat16: (np.uint16, torch.uint16)}
_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FROM_NAME = {v: k for k, v in _NAMES.items()}


@dataclass
class KVMeta:
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name of the cached values
    layout: str  # one of LAYOUTS
    num_kv_tokens: int  # the tokens of `token_ids` whose K/V the package holds end here
    block_size: int  # the exporting engine's KV block size (informational)
    source: str = ""  # device / replica that exported it
    v_head_dim: int = 0  # the values' head size where it differs from the keys' (MLA); 0: head_dim
    # Tokens at the head whose K/V the package leaves out (a multiple of the exporter's block size):
    # the router expects the importing engine to hold them in its prefix cache, so their bytes do
    # not move. The arrays hold tokens [kv_start, num_kv_tokens). An importer that does not hold
    # them computes the sequence again from what it does hold (LLMEngine, scheduler.py).
    kv_start: int = 0

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(layers, kv_heads, key head size, value head size): what an importer must match."""
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.v_head_dim or self.head_dim)


@dataclass
class KVPackage:
    meta: KVMeta
    keys: np.ndarray
    values: np.ndarray
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: dict
    rng_state: np.ndarray | None = None
    emitted_text_chars: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


def to_wire(t: torch.Tensor, layout: str) -> np.ndarray:
    """[L, H, T, D] tensor on the CPU -> numpy in `layout`, bf16 as uint16."""
    assert layout in LAYOUTS, f"unknown KV layout {layout!r}; known: {LAYOUTS}"
    if layout == "LTHD":
        t = t.permute(0, 2, 1, 3).contiguous()
    _, view = _WIRE[t.dtype]
    return (t.view(view) if view is not None else t).numpy()


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def check_span(pkg: KVPackage) -> None:
    """The arrays hold exactly tokens [kv_start, num_kv_tokens) of a sequence that has them."""
    m = pkg.meta
    axis = 2 if m.layout == "LHTD" else 1
    n = m.num_kv_tokens - m.kv_start
    if not 0 <= m.kv_start <= m.num_kv_tokens <= len(pkg.token_ids) or any(
            a.ndim != 4 or a.shape[axis] != n for a in (pkg.keys, pkg.values)):
        raise ValueError(f"KV package arrays do not hold tokens [{m.kv_start}, {m.num_kv_tokens}) of its "
                         f"{len(pkg.token_ids)} tokens")


def to_engine_tensors(pkg: KVPackage, dtype: torch.dtype, device: torch.device,
                      expect: tuple[int, int, int, int], start: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Package arrays -> [L, H, T, D] tensors in the importer's dtype, on its device: tokens
    [start, num_kv_tokens) (`start`: from the package's first, `meta.kv_start`, on; the
    importer's cache holds the ones before)."""
    m = pkg.meta
    got = m.dims
    if got != expect:
        raise ValueError(f"KV package shape (layers, kv_heads, k_dim, v_dim)={got} does not match "
                         f"this engine's model {expect}")
    src_dtype = _FROM_NAME[m.dtype]

    skip = 0 if start is None else start - m.kv_start
    assert 0 <= skip <= m.num_kv_tokens - m.kv_start, (start, m.kv_start, m.num_kv_tokens)

    def convert(a: np.ndarray) -> torch.Tensor:
        a = a[:, :, skip:] if m.layout == "LHTD" else a[:, skip:]
        t = torch.from_numpy(a)  # shares memory with the (possibly read-only) object-store view
        if src_dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        if m.layout == "LTHD":
            t = t.permute(0, 2, 1, 3)
        return t.to(device=device, dtype=dtype)

    return convert(pkg.keys), convert(pkg.values)
