"""RMSNorm as one Triton kernel on CUDA (issue #21): the model's own norm modules, swapped.

transformers' RMSNorm is about seven kernels (a cast, pow, mean, add, rsqrt, two products and a
cast back); a decode step runs it four times a layer (Qwen3: input, post-attention, q and k
norms), so on the H200 a 0.4B step replayed about 680 of its 770 kernels for norms. Here one
program per row does all of it in float32 and rounds where the module does: Llama's form
(`weight * (x * r).to(dtype)`, Qwen, Mistral and most others) or Gemma's (`(x * r * (1 + weight))
.to(dtype)`). A module is swapped only after its own forward and the kernel agreed on random
rows of its shape (within two rounding steps of its dtype: the two reduce in different orders);
the first form that agrees is kept, a module neither matches keeps its own forward.

Under `TRITON_INTERPRET=1` the same kernel runs on CPU tensors (float32, float16), which is how
the tests check it; the runner asks for it on CUDA, or where `KEYACC_GPU_FUSE=triton` forces it.
"""
from __future__ import annotations

import logging
import types

import torch

from keyacc_ray.engine import triton_attention

log = logging.getLogger(__name__)

tl = None  # triton.language, set when the kernel is first jitted (its body names it)


def _rms_norm_py(X, W, Y, sx, sy, N, eps, BLOCK: tl.constexpr, GEMMA: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(X + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    if GEMMA:
        y = x * r * (1.0 + w)
    else:
        y = (x * r).to(X.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=m)


_kernel = triton_attention.lazy_jit(_rms_norm_py)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """RMSNorm over x's last dimension: Llama's form (out dtype: weight's and x's promoted) or
    Gemma's (out dtype: x's)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = max(16, 1 << (n - 1).bit_length())
        _kernel()[(rows,)](x2, weight, y, x2.stride(0), n, n, float(eps), BLOCK=block, GEMMA=gemma,
                          num_warps=min(16, max(1, block // 256)))
    return y


def _eps(module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(module, name, None)
        if isinstance(v, float):
            return v
    return None


def rounding_step(dtype: torch.dtype) -> float:
    """A few of the dtype's rounding steps, relative (float32: a few ulps): how far a kernel that
    rounds where the torch expression does, or one step elsewhere, may land from it."""
    return {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}.get(dtype, 2.0 ** -6)


def _agrees(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within two rounding steps of the dtype, element-wise (float32: a few ulps): the product
    after the rounded normalised row can carry one step of its own."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    step = rounding_step(ref.dtype)
    g, r = got.float(), ref.float()
    return bool(((g - r).abs() <= step * r.abs() + 1e-6).all())


def fuse_rms_norms(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """Swap the forward of every RMSNorm module of `model` (a class named ...RMSNorm with a 1-D
    weight and a float epsilon) for the kernel, where it agrees with the module's own on random
    rows; returns {"fused": n, "kept": m} (kept: left with their own forward)."""
    g = torch.Generator(device="cpu").manual_seed(3)
    forms: dict[tuple, bool | None] = {}  # (class, width, weight dtype) -> gemma form, None: neither
    fused = kept = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        eps = _eps(mod)
        if not type(mod).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) or w.dim() != 1 \
                or eps is None:
            continue
        key = (type(mod), w.shape[0], w.dtype)
        if key not in forms:
            x = (torch.randn((5, w.shape[0]), generator=g) * 3).to(device, dtype)
            with torch.inference_mode():
                ref = mod(x)
                forms[key] = next((gemma for gemma in (False, True)
                                   if _agrees(rms_norm(x, w, eps, gemma), ref)), None)
            if forms[key] is None:
                log.info("%s (width %d) kept its own forward: the fused RMSNorm does not reproduce it",
                         type(mod).__name__, w.shape[0])
        gemma = forms[key]
        if gemma is None:
            kept += 1
            continue
        mod.forward = types.MethodType(lambda self, x, _g=gemma, _e=eps: rms_norm(x, self.weight, _e, _g), mod)
        fused += 1
    return {"fused": fused, "kept": kept}
