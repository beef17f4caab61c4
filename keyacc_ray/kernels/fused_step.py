"""A decode step for Llama-family layers with a handful of kernel calls per layer.

transformers' decoder layer costs 60-odd torch dispatches per token step (views, rotary's
cat/neg/mul/add, cache index_put, SDPA with repeat_kv); at batch 1 that Python and dispatch
time is a third of the step once the matmuls run at memory speed. This step does per layer:
norm -> one q|k|v product -> one norm+rotary+KV-write kernel -> decode attention -> o product ->
residual-add+norm -> gate|up product -> SiLU-multiply -> down product -> residual-add+norm.

It is built only from a model whose layers have that shape after `fastpath.apply` (fused norms,
fused gate|up MLP), and the engine uses it only after it reproduced the model's own decode
logits on a probe (`ModelRunner._check_fused_step`). Anything else keeps transformers' forward.

The loop over the layers runs in C++ (`decode_layers`: the same kernel calls in the same order,
the same bits) without coming back to Python, and to the GIL, between a layer's calls.
"""
from __future__ import annotations

import torch
from torch import nn

from keyacc_ray.kernels.fastpath import DenseLinear, FusedGateUpMLP, FusedRMSNorm, PackedLinear


def _linear(mod: nn.Module):
    if isinstance(mod, PackedLinear):
        k, packed, scales, n, bias = mod.k, mod.packed, mod.scales, mod.out_features, mod.bias
        if scales is not None:
            return lambda x: k.linear_int8(x, packed, scales, n, bias)
        return lambda x: k.linear_bf16(x, packed, n, bias)
    if isinstance(mod, (nn.Linear, DenseLinear)):
        w, b = mod.weight, mod.bias
        return lambda x: nn.functional.linear(x, w, b)
    return None


_NONE = torch.empty(0)  # decode_layers' "this layer has none"


def _packed(mod: nn.Module) -> tuple | None:
    """A product's (weights, int8 scales, bias, width) as decode_layers takes them: packed
    weights, or a plain weight (torch's own linear there, as `_linear`'s)."""
    bias = _NONE if getattr(mod, "bias", None) is None else mod.bias.detach()
    if isinstance(mod, PackedLinear):
        return mod.packed, _NONE if mod.scales is None else mod.scales, bias, mod.out_features
    if isinstance(mod, (nn.Linear, DenseLinear)):
        return mod.weight.detach(), _NONE, bias, mod.out_features
    return None


def _fused_qkv(attn: nn.Module):
    """One product for q, k and v where all three are packed alike (bf16, or int8 with scales)
    with widths that are whole 64-row groups: their packed weights are concatenated (the packed
    layout is per group of 64 output rows, so the concatenation is the packing of the stacked
    weight) and each module keeps a view of its part, so no weight is held twice. Returns
    (product, q width, k width, its `_packed` tuple), or None. At batch 1 this is a third fewer
    kernel calls a layer, and one longer weight stream instead of three short ones."""
    mods = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(m, PackedLinear) for m in mods):
        return None
    q, k, v = mods
    if (len({m.quant for m in mods}) != 1 or len({m.in_features for m in mods}) != 1
            or any(m.out_features % 64 for m in mods) or len({m.bias is None for m in mods}) != 1):
        return None
    packed = torch.cat([m.packed for m in mods])
    scales = torch.cat([m.scales for m in mods]) if q.scales is not None else None
    bias = torch.cat([m.bias.detach() for m in mods]) if q.bias is not None else None
    at = 0
    for m in mods:  # each module's weight becomes its part of the one tensor
        g = m.packed.shape[0]
        m.packed = packed[at:at + g]
        if scales is not None:
            m.scales = scales[at * 64:at * 64 + m.out_features]
        at += g
    n = packed.shape[0] * 64
    kern = q.k
    if scales is not None:
        fn = lambda x: kern.linear_int8(x, packed, scales, n, bias)  # noqa: E731
    else:
        fn = lambda x: kern.linear_bf16(x, packed, n, bias)  # noqa: E731
    raw = (packed, _NONE if scales is None else scales, _NONE if bias is None else bias, n)
    return fn, q.out_features, k.out_features, raw


class _Layer:
    # packed: `_packed` tuples of (q|k|v or q, k or None, v or None, o, gate|up, down), or None
    __slots__ = ("ln1", "ln2", "q", "k", "v", "qkv", "nq", "nk", "o", "qn", "kn", "qk_eps", "gate_up", "down",
                 "scale", "kind", "idx", "packed")


class FusedDecodeStep:
    def __init__(self, kernels, embed, rotary, layers: list[_Layer], norm: FusedRMSNorm, lm_head, dtype):
        self.k = kernels
        self.embed, self.rotary, self.layers, self.norm, self.lm_head = embed, rotary, layers, norm, lm_head
        self.dtype = dtype
        self.native = self.native_args()  # decode_layers' per-layer arguments, or None: the Python loop
        self.in_order = [L.idx for L in layers] == list(range(len(layers)))

    def native_args(self) -> tuple | None:
        """decode_layers' per-layer arguments, from the layers as they are now (None: no such kernel)."""
        if not hasattr(self.k, "decode_layers") or any(L.packed is None for L in self.layers):
            return None
        w, iv, fv = [], [], []
        for j, L in enumerate(self.layers):
            (qkv, qs, qb, nqkv), kp, vp, (o, os_, ob, no), (gu, gs, gb, ngu), (dn, ds, db, nd) = L.packed
            nxt = self.layers[j + 1].ln1 if j + 1 < len(self.layers) else self.norm
            w += [qkv, qs, qb, _NONE if L.qn is None else L.qn, _NONE if L.kn is None else L.kn, o, os_, ob,
                  L.ln2.weight, gu, gs, gb, dn, ds, db, nxt.weight]
            if kp is None:  # one q|k|v product
                w += [_NONE] * 6
                iv += [L.nq, L.nk, nqkv - L.nq - L.nk]
            else:  # q (above), k and v separate
                w += [*kp[:3], *vp[:3]]
                iv += [nqkv, kp[3], vp[3]]
            iv += [no, ngu, nd]
            fv += [float(L.ln2.eps), float(nxt.eps), float(L.qk_eps), float(L.scale)]
        return [t.detach() for t in w], iv, fv

    @classmethod
    def build(cls, model: nn.Module, kernels) -> "FusedDecodeStep | None":
        inner = getattr(model, "model", None)
        need = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in need) or not isinstance(inner.norm, FusedRMSNorm):
            return None
        lm_head = _linear(getattr(model, "lm_head", None))
        if lm_head is None:
            return None
        layers = []
        types = getattr(getattr(model, "config", None), "layer_types", None)
        for i, layer in enumerate(inner.layers):
            got = cls._layer(layer, i, types[i] if types and i < len(types) else None)
            if got is None:
                return None
            layers.append(got)
        dtype = inner.norm.weight.dtype
        return cls(kernels, inner.embed_tokens, inner.rotary_emb, layers, inner.norm, lm_head, dtype)

    @staticmethod
    def _layer(layer: nn.Module, i: int, layer_type: str | None = None) -> _Layer | None:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        ln1, ln2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
        if not (isinstance(ln1, FusedRMSNorm) and isinstance(ln2, FusedRMSNorm) and isinstance(mlp, FusedGateUpMLP)):
            return None
        projs = [_linear(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        down = _linear(mlp.down_proj)
        if any(p is None for p in projs) or down is None or not hasattr(attn, "scaling"):
            return None
        if getattr(attn, "sinks", None) is not None or getattr(attn, "attn_logit_softcapping", None):
            return None
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (qn is None) != (kn is None):
            return None
        if qn is not None and not (isinstance(qn, FusedRMSNorm) and isinstance(kn, FusedRMSNorm) and qn.eps == kn.eps):
            return None
        out = _Layer()
        out.ln1, out.ln2 = ln1, ln2
        out.q, out.k, out.v, out.o = projs
        fused = _fused_qkv(attn)
        out.qkv, out.nq, out.nk, raw = fused if fused is not None else (None, 0, 0, None)
        sep = [_packed(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")] if raw is None else [raw, None, None]
        rest = [_packed(m) for m in (attn.o_proj, mlp.gate_up, mlp.down_proj)]
        out.packed = None if sep[0] is None or None in rest or (raw is None and None in sep) else (*sep, *rest)
        out.qn = None if qn is None else qn.weight
        out.kn = None if kn is None else kn.weight
        out.qk_eps = 0.0 if qn is None else qn.eps
        out.gate_up, out.down = _linear(mlp.gate_up), down
        out.scale = float(attn.scaling)
        out.kind = getattr(layer, "attention_type", None) or layer_type or "full_attention"
        out.idx = i
        return out

    @torch.inference_mode()
    def __call__(self, token_ids, positions, blk, off, tables, ctx, kpools, vpools, windows):
        """Decode rows over the paged pool: token_ids, positions [B]; blk, off [B] where each row's
        new K/V goes (block, row in block); tables [B, max_blocks] int32; ctx [B] int64 (keys to
        attend over, the new one included); kpools / vpools per layer [num_blocks, Hkv, bs, D];
        windows per layer (0: full attention). Returns logits [B, vocab]."""
        K = self.k
        B = token_ids.shape[0]
        h = self.embed(token_ids)  # [B, hidden]
        cos, sin = self.rotary(h[:, None], positions[:, None])
        cos, sin = cos.reshape(B, -1).to(h.dtype), sin.reshape(B, -1).to(h.dtype)
        res = h.contiguous()
        x = K.rms_norm(res, self.layers[0].ln1.weight, self.layers[0].ln1.eps)
        if self.native is not None:
            if self.in_order and len(kpools) == len(self.layers):
                kp, vp, win = kpools, vpools, [int(w) for w in windows]
            else:
                kp, vp = [kpools[L.idx] for L in self.layers], [vpools[L.idx] for L in self.layers]
                win = [int(windows[L.idx]) for L in self.layers]
            x = K.decode_layers(x, res, cos, sin, *self.native, kp, vp, win, tables, ctx, off, blk)
            return self.lm_head(x)
        n = len(self.layers)
        for j, L in enumerate(self.layers):
            kb, vb = kpools[L.idx], vpools[L.idx]
            if L.qkv is not None:
                y = L.qkv(x)
                qx, kx, vx = y[:, :L.nq], y[:, L.nq:L.nq + L.nk], y[:, L.nq + L.nk:]
            else:
                qx, kx, vx = L.q(x), L.k(x), L.v(x)
            q = K.rope_kv_write(qx, kx, vx, L.qn, L.kn, L.qk_eps, cos, sin, kb, vb, off, blk)
            a = K.paged_decode_attention(q, kb, vb, tables, ctx, int(windows[L.idx]), L.scale)
            x = K.add_rms_norm(L.o(a.view(B, -1)), res, L.ln2.weight, L.ln2.eps)
            m = L.down(K.silu_mul(L.gate_up(x)))
            nxt = self.layers[j + 1].ln1 if j + 1 < n else self.norm
            x = K.add_rms_norm(m, res, nxt.weight, nxt.eps)
        return self.lm_head(x)
