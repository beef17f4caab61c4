"""Attention over the paged KV pool, for one step's packed tokens.

The engine's KV lives in one pool per layer, `[num_blocks, kv_heads, block_size, dim]`; a
sequence's token at position p sits in block `table[p // block_size]`, row `p % block_size`.
A step feeds every scheduled sequence's new tokens (one per decoding sequence, a chunk of a
prompt for a prefilling one) as one packed row: `input_ids [1, T]`, each token with its own
position. The model's attention layers call `PagedKVCache.update` (which writes the new keys and
values into their blocks) and then the attention function registered here as transformers
implementation "keyacc_paged", which reads each sequence's keys through its block table:

- decode rows, batched: the CPU kernel (`paged_decode_attention`: GQA without repeating K/V, a
  batch of mixed lengths, nothing padded) where it is loaded, else the torch reference (gather
  the rows' blocks, one SDPA with a [rows, 1, 1, L] boolean mask);
- a prompt chunk: SDPA over its own keys with `is_causal` when nothing is cached before it (no
  mask at all), else over its cached blocks and itself with a [chunk, context] mask. Never a
  [rows, T, T] mask over the packed batch.

Models whose attention does not go through transformers' attention interface, or passes what this
function does not implement (logit soft-capping, attention sinks), are refused here by raising
`PagedUnsupported`; the runner's load probe then keeps the model's own attention over gathered
KV (`PagedKVCache` in gather mode).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from keyacc_ray.engine import triton_attention

ATTN_NAME = "keyacc_paged"


class PagedUnsupported(RuntimeError):
    pass


@dataclass
class StepBatch:
    """One forward's tokens and where their KV goes / comes from. Built by the runner."""

    input_ids: torch.Tensor  # [rows, T]: packed [1, T], or a gather-mode batch
    positions: torch.Tensor  # same shape
    blk: torch.Tensor  # [tokens] long: the block each new token's KV goes to (row-major order)
    off: torch.Tensor  # [tokens] long: its row in that block
    # packed mode: per sequence, where its tokens sit in the packed row and how much is cached
    q_starts: list[int]
    q_lens: list[int]
    starts: list[int]  # tokens cached before this step
    tables: list[torch.Tensor]  # per sequence: its block ids (long) covering start + q_len tokens
    dec: torch.Tensor | None = None  # packed indices of decode rows (one token, something cached)
    dec_tables: torch.Tensor | None = None  # [rows, max_blocks] int32
    dec_tables_long: torch.Tensor | None = None
    dec_ctx: torch.Tensor | None = None  # [rows] int64: keys each decode row attends over
    chunks: list[int] | None = None  # sequence indices of the prompt chunks attended one by one (SDPA)
    gather: bool = False  # gather mode: update() returns the batch's keys and values, padded
    gather_idx: torch.Tensor | None = None  # [rows, blocks] long
    kv_len: int = 0
    all_decode: bool = False  # every packed token is a decode row (row i = packed index i): no chunk
    kernel_chunks: list[int] | None = None  # those the Triton prefill kernel attends, all in one launch
    chunk_tables: torch.Tensor | None = None  # [those chunks, width] int32: their block tables
    chunk_meta: dict | None = None  # what that kernel sends to the device once per step


class PagedKVCache:
    """Duck-typed transformers cache over the block pool (see the module docstring)."""

    is_compileable = False

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype, device: torch.device, zeros=None):
        """`zeros(shape, dtype)`: how a CPU pool's layers are allocated (the CPU kernels'
        `zeros_huge`, on 2 MB pages: decode attention streams them); torch.zeros by default."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        if zeros is None or device.type != "cpu":
            def zeros(shape, dt):
                return torch.zeros(shape, dtype=dt, device=device)
        self.k = [zeros([num_blocks, kv_heads, block_size, k_dim], dtype) for _ in range(num_layers)]
        self.v = [zeros([num_blocks, kv_heads, block_size, v_dim], dtype) for _ in range(num_layers)]
        self.batch: StepBatch | None = None
        # write(key, value, k_pool, v_pool, blk, off) -> bool: the new keys and values in one kernel
        # (the runner sets triton_attention.write_kv where the Triton kernels attend); None, or
        # False back: the torch copies below
        self.write = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        b = self.batch
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self.write is None or not self.write(key_states, value_states, k, v, b.blk, b.off):
            ks = key_states.transpose(1, 2).reshape(-1, key_states.shape[1], key_states.shape[3])  # [tokens, H, D]
            vs = value_states.transpose(1, 2).reshape(-1, value_states.shape[1], value_states.shape[3])
            k[b.blk, :, b.off] = ks
            v[b.blk, :, b.off] = vs
        if not b.gather:
            return key_states, value_states
        return gather(k, b.gather_idx, b.kv_len), gather(v, b.gather_idx, b.kv_len)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def gather(pool: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """[rows, kv_heads, length, dim] from the pool through block tables [rows, blocks] (long)."""
    rows, nb = tables.shape
    g = pool[tables]  # [rows, blocks, H, bs, D]
    return g.permute(0, 2, 1, 3, 4).reshape(rows, pool.shape[1], nb * pool.shape[2], pool.shape[3])[:, :, :length]


class PagedAttention:
    """The attention function: bound to one runner's cache, windows and kernels."""

    def __init__(self, cache: PagedKVCache, windows: list[int], kernels=None):
        self.cache = cache
        self.windows = windows  # per layer: 0 (full attention) or the sliding window
        self.kernels = kernels  # the CPU extension, for decode rows on CPU
        # "cpu" (the extension's kernel for decode rows), "triton" (engine/triton_attention.py on CUDA:
        # decode rows and prompt chunks), "torch" (reference_decode, SDPA per chunk); the runner's choice
        self.kernel = "cpu" if kernels is not None else "torch"
        self.calls = 0

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if (dropout or kwargs.get("softcap") or kwargs.get("s_aux") is not None
                or getattr(module, "sinks", None) is not None or query.shape[0] != 1
                or not hasattr(module, "layer_idx") or self.cache.batch is None or self.cache.batch.gather):
            raise PagedUnsupported(f"{type(module).__name__}: attention the paged path does not implement")
        self.calls += 1
        b = self.cache.batch
        layer = module.layer_idx
        kp, vp = self.cache.k[layer], self.cache.v[layer]
        window = self.windows[layer]
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        q = query[0]  # [H, T, D]
        if b.all_decode:
            return self._decode(q.transpose(0, 1)[:, :, None], kp, vp, b, window, scale)[:, 0][None], None
        out = torch.empty((q.shape[1], q.shape[0], vp.shape[-1]), dtype=query.dtype, device=query.device)
        if b.dec is not None:
            qd = q[:, b.dec].transpose(0, 1)[:, :, None]  # [rows, H, 1, D]
            out[b.dec] = self._decode(qd, kp, vp, b, window, scale)[:, 0]
        if b.kernel_chunks:  # those chunks in one launch; the rest (long fresh prompts) below
            c = b.kernel_chunks
            triton_attention.paged_prefill(q.transpose(0, 1), kp, vp, b.chunk_tables, [b.q_starts[i] for i in c],
                                           [b.q_lens[i] for i in c], [b.starts[i] for i in c], window, scale, out,
                                           b.chunk_meta)
        for i in b.chunks:
            s, t, start = b.q_starts[i], b.q_lens[i], b.starts[i]
            qs = q[None, :, s:s + t]
            if start == 0:
                ks, vs = key[:, :, s:s + t], value[:, :, s:s + t]
            else:
                ks, vs = gather(kp, b.tables[i][None], start + t), gather(vp, b.tables[i][None], start + t)
            mask, causal = None, start == 0
            if start or (window and start + t > window):
                qpos = torch.arange(start, start + t, device=q.device)[:, None]
                kpos = torch.arange(start + t, device=q.device)[None]
                mask = kpos <= qpos
                if window:
                    mask &= qpos - kpos < window
                causal = False
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=True)
            out[s:s + t] = o[0].transpose(0, 1)
        return out[None], None

    def _decode(self, qd, kp, vp, b: StepBatch, window: int, scale: float) -> torch.Tensor:
        K = self.kernels
        if self.kernel == "triton":
            return triton_attention.paged_decode(qd, kp, vp, b.dec_tables, b.dec_ctx, window, scale)
        if (self.kernel == "cpu" and qd.device.type == "cpu" and qd.dtype in (torch.float32, torch.bfloat16)
                and kp.dtype == qd.dtype and kp.shape[-1] == vp.shape[-1] == qd.shape[-1]):
            return K.paged_decode_attention(qd, kp, vp, b.dec_tables, b.dec_ctx, window, scale)
        tables = b.dec_tables_long if b.dec_tables_long is not None else b.dec_tables.long()
        return reference_decode(qd, kp, vp, tables, b.dec_ctx, window, scale)


def reference_decode(qd, kp, vp, tables_long, ctx, window: int, scale: float) -> torch.Tensor:
    """Decode attention in plain torch: gather each row's blocks, mask past its own length (and
    outside its window), one SDPA. Returns [rows, 1, H, Dv]."""
    length = tables_long.shape[1] * kp.shape[2]
    kg, vg = gather(kp, tables_long, length), gather(vp, tables_long, length)
    j = torch.arange(length, device=qd.device)[None]
    ok = j < ctx[:, None]
    if window:
        ok &= j >= ctx[:, None] - window
    o = F.scaled_dot_product_attention(qd, kg, vg, attn_mask=ok[:, None, None], scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


_active = threading.local()  # the PagedAttention of the forward running on this thread
_registered = False


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    fn = getattr(_active, "fn", None)
    if fn is None:  # the model called directly (no engine step): plain SDPA over what it was given
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return fn(module, query, key, value, attention_mask, **kwargs)


class active:
    """`with active(attn): model(...)`: the forward's attention layers use `attn`."""

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        self.prev = getattr(_active, "fn", None)
        _active.fn = self.fn

    def __exit__(self, *exc):
        _active.fn = self.prev


def register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _dispatch)
        _registered = True
