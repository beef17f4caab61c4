"""Projections that read the same input as one matrix product (issue #21), as vLLM loads them:
an attention layer's q, k and v projections, an MLP's gate and up projections.

transformers calls them one by one on the same hidden states (`self.q_proj(x)`, `self.k_proj(x)`,
`self.v_proj(x)`); on a GPU at small batches each product is a short kernel that does not fill
the device (the 0.4B shape's products at batch 1 ran at 0.7 TB/s on the H200). Here the weights
are concatenated once (the originals dropped: no second copy), and each projection module is
replaced by a part of the fused one: the first part called with an input runs the one product
and keeps it until every part took its slice, the others called with the same tensor object
take their slice of it; a part called with another input (a model that projects something else) runs the product itself.
Each group is swapped only where the fused product agrees with the separate ones on random rows.
No Triton: the same on any device (the runner asks for it on CUDA).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Product:
    """The fused product being handed out, and the input it ran on (held while parts are still to
    take their slices: its identity is the key). Dropped once every part took its slice, so no
    step's activations outlive it (held, the 14B shape's 8k-token gate/up products were 21 GiB)."""
    __slots__ = ("x", "y", "taken", "parts")

    def __init__(self, parts: int):
        self.x = self.y = None
        self.taken, self.parts = 0, parts


class FusedPart(torch.nn.Module):
    """One projection of a fused group: its slice [lo, hi) of the group's output features."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None, lo: int, hi: int,
                 product: _Product):
        super().__init__()
        self.weight, self.bias = weight, bias  # the group's, shared (model.parameters() counts them once)
        self.lo, self.hi = lo, hi
        self.in_features, self.out_features = weight.shape[1], hi - lo
        self._product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self._product
        if p.x is not x:
            p.x = p.y = None  # (a product some part never took: freed before the next one)
            p.x, p.y, p.taken = x, F.linear(x, self.weight, self.bias), 0
        out = p.y[..., self.lo:self.hi]
        p.taken += 1
        if p.taken >= p.parts:
            p.x = p.y = None
        return out


def _fusable(lins: list) -> bool:
    if not all(type(m) is torch.nn.Linear for m in lins):
        return False
    w0 = lins[0].weight
    return (all(m.weight.shape[1] == w0.shape[1] and m.weight.dtype == w0.dtype and m.weight.device == w0.device
                for m in lins)
            and len({m.bias is None for m in lins}) == 1)


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    tol = 1e-5 if ref.dtype == torch.float32 else 1e-2  # (the products may reduce in another order)
    return float((got.float() - ref.float()).norm()) <= tol * float(ref.float().norm()) + 1e-6


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse every group of GROUPS found on a module of `model` (plain nn.Linear, same input size,
    dtype and device, biases on all or none), each after its check; returns the groups fused."""
    g = torch.Generator(device="cpu").manual_seed(7)
    fused = 0
    for mod in list(model.modules()):
        for names in GROUPS:
            lins = [getattr(mod, n, None) for n in names]
            if not _fusable(lins):
                continue
            w0 = lins[0].weight
            with torch.no_grad():
                weight = torch.nn.Parameter(torch.cat([m.weight for m in lins]), requires_grad=False)
                bias = (None if lins[0].bias is None else
                        torch.nn.Parameter(torch.cat([m.bias for m in lins]), requires_grad=False))
            product, parts, lo = _Product(len(lins)), [], 0
            for m in lins:
                parts.append(FusedPart(weight, bias, lo, lo + m.out_features, product))
                lo += m.out_features
            x = torch.randn((3, w0.shape[1]), generator=g).to(w0.device, w0.dtype)
            with torch.inference_mode():
                ok = all(_close(p(x), m(x)) for p, m in zip(parts, lins))
            if not ok:
                log.info("%s.%s kept apart: the fused product does not reproduce them", type(mod).__name__,
                         "/".join(names))
                continue
            for n, p in zip(names, parts):
                setattr(mod, n, p)
            fused += 1
    return fused
