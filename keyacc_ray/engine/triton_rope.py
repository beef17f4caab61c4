"""Rotary position embedding of queries and keys as one Triton kernel each on CUDA (issue #21).

transformers applies it as `q * cos + rotate_half(q) * sin` (two slices, a negation, a cat, two
products, a sum: about ten kernels a layer for q and k). Here one program per (token, head)
does the half-rotation in registers and rounds where the torch expression does (each product
and the sum to the tensor's dtype), so it is the same arithmetic, not an approximation. The
swap is of the model's modeling module's `apply_rotary_pos_emb` (the attention layers call it by
that name), wrapped: CUDA tensors of the usual layout ([batch, heads, tokens, dim], cos / sin
[batch, tokens, dim], `unsqueeze_dim` 1) go through the kernel, anything else (a CPU replica in
the same process, partial rotary, another layout) through the original. It is kept only where it
agrees with the original on random inputs of the model's shapes.
"""
from __future__ import annotations

import logging
import sys

import torch

from keyacc_ray.engine import triton_attention

log = logging.getLogger(__name__)

tl = None  # triton.language, set when the kernel is first jitted (its body names it)


def _rope_py(X, C, S, Y, sxb, sxh, sxt, scb, sct, ssb, sst, syb, syh, syt, T, HALF: tl.constexpr,
             BLOCK: tl.constexpr):
    bt = tl.program_id(0)
    h = tl.program_id(1)
    b = bt // T
    t = bt % T
    i = tl.arange(0, BLOCK)
    m = i < HALF
    x = X + b * sxb + h * sxh + t * sxt
    x1 = tl.load(x + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + i, mask=m, other=0.0).to(tl.float32)
    c = C + b * scb + t * sct
    s = S + b * ssb + t * sst
    c1 = tl.load(c + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(s + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF + i, mask=m, other=0.0).to(tl.float32)
    dt = Y.dtype.element_ty
    lo = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    hi = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    y = Y + b * syb + h * syh + t * syt
    tl.store(y + i, lo.to(dt), mask=m)
    tl.store(y + HALF + i, hi.to(dt), mask=m)


_kernel = triton_attention.lazy_jit(_rope_py)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] (any strides, D even, last stride 1), cos / sin [B or 1, T, D]: x rotated, in
    x's dtype and layout."""
    bsz, heads, t, d = x.shape
    y = torch.empty_like(x)
    if x.numel():
        half = d // 2
        _kernel()[(bsz * t, heads)](x, cos, sin, y, x.stride(0), x.stride(1), x.stride(2),
                                   cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
                                   sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1),
                                   y.stride(0), y.stride(1), y.stride(2), t, HALF=half,
                                   BLOCK=max(16, 1 << (half - 1).bit_length()))
    return y


def _usual(q, k, cos, sin, unsqueeze_dim) -> bool:
    return (unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape
            and cos.shape[-1] == q.shape[-1] == k.shape[-1] and q.shape[-1] % 2 == 0
            and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and cos.dtype == q.dtype == k.dtype and cos.shape[1] == q.shape[2] == k.shape[2]
            and cos.shape[0] in (1, q.shape[0]))


def _agrees(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Within a few rounding steps of the two products' magnitudes, element-wise: where q*cos and
    rotate_half(q)*sin nearly cancel, a step of either is many steps of their sum, so the sum's
    own magnitude is no yardstick (a kernel that rounds another way, e.g. Triton's interpreter,
    which truncates to bf16, differs there by more than a step of the result)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    from keyacc_ray.engine.triton_norm import rounding_step

    step = rounding_step(ref.dtype)
    xf, c, s = x.float(), cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    half = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    scale = (xf * c).abs() + (rot * s).abs()
    return bool(((got.float() - ref.float()).abs() <= step * scale + 1e-6).all())


def fuse_rotary(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """Route the model's `apply_rotary_pos_emb` through the kernel for tensors on `device`'s kind.
    "fused" where it is now (already, or here after agreeing with the original); otherwise why
    not ("kept: ..."), which the runner reports in its `fused_ops`."""
    mod = sys.modules.get(type(model).__module__)
    orig = getattr(mod, "apply_rotary_pos_emb", None)
    if orig is None:
        return "kept: the modeling module has no apply_rotary_pos_emb"
    if getattr(orig, "_keyacc_devices", None) is not None:  # another engine of this process did it
        orig._keyacc_devices.add(device.type)
        return "fused"
    devices = {device.type}

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if q.device.type in devices and _usual(q, k, cos, sin, unsqueeze_dim):
            return rope(q, cos, sin), rope(k, cos, sin)
        return orig(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._keyacc_devices = devices
    apply_rotary_pos_emb._keyacc_original = orig
    cfg = model.config
    heads = cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    g = torch.Generator(device="cpu").manual_seed(9)
    q = torch.randn((2, 6, heads, dim), generator=g).to(device, dtype).transpose(1, 2)  # the models' layout
    k = torch.randn((2, 6, kvh, dim), generator=g).to(device, dtype).transpose(1, 2)
    ang = torch.randn((2, 6, dim // 2), generator=g) * 3
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(device, dtype)
    try:
        with torch.inference_mode():
            ref = orig(q, k, cos, sin)
            got = apply_rotary_pos_emb(q, k, cos, sin)
        if not _usual(q, k, cos, sin, 1):
            return "kept: the model's shapes are not the kernel's layout"
        bad = [n for n, a, b, x in zip("qk", got, ref, (q, k)) if not _agrees(a, b, x, cos, sin)]
    except Exception as e:  # noqa: BLE001 - not this model's rotary (another signature, partial rotary)
        log.info("rotary embedding of %s kept (%s: %s)", type(model).__name__, type(e).__name__, e)
        return f"kept: {type(e).__name__}: {e}"[:200]
    if bad:
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref))
        log.info("rotary embedding of %s kept: the fused kernel does not reproduce it", type(model).__name__)
        return f"kept: {'/'.join(bad)} off by up to {worst:.3g}"
    mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    return "fused"
