"""The CPU fast path: swap a loaded transformers model's hot parts for the C++ kernels.

Nothing here knows an architecture by name. Each swap is checked on the module itself before it
is made: the replacement must reproduce the original module's output on random input (exactly
for linear layers' shapes, within a rounding step for norms and the MLP), else the original stays.
What is swapped:
- `nn.Linear` with bf16 weights -> `PackedLinear` (weights prepacked once, AVX512-BF16 kernel)
- an MLP of `gate_proj`/`up_proj`/`down_proj` + SiLU -> one gate|up product + fused SiLU-multiply
- RMSNorm-like modules (`weight` + `variance_epsilon`/`eps`) -> fused RMSNorm
Attention is not swapped here: the engine's paged attention (`engine/paged_attention.py`)
calls the kernels' `paged_decode_attention` for decode rows itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger(__name__)

@dataclass
class FastPathReport:
    isa: str = "none"
    quant: str | None = None
    linear: int = 0
    mlp: int = 0
    norm: int = 0
    kept: list[str] = field(default_factory=list)  # modules whose check failed

    def summary(self) -> str:
        return (f"isa={self.isa} quant={self.quant or 'none'} linear={self.linear} mlp={self.mlp} norm={self.norm} "
                f"kept={len(self.kept)}")


class PackedLinear(nn.Module):
    """y = x W^T + b with W prepacked for the kernel (bf16, or int8 with per-row scales when
    `quant="int8"`). The packed copy replaces the weight."""

    def __init__(self, kernels, weight: torch.Tensor, bias: torch.Tensor | None, quant: str | None = None):
        super().__init__()
        self.k = kernels
        self.quant = quant
        self.out_features, self.in_features = weight.shape
        w = weight.detach().contiguous()
        if quant == "int8":
            packed, scales = kernels.pack_int8(w)
            self.register_buffer("scales", scales, persistent=False)
        else:
            packed, self.scales = kernels.pack_bf16(w), None
        self.register_buffer("packed", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if self.scales is not None:
            return self.k.linear_int8(x, self.packed, self.scales, self.out_features, self.bias)
        return self.k.linear_bf16(x, self.packed, self.out_features, self.bias)


class DenseLinear(nn.Module):
    """A plain linear layer around given weights (no initialisation pass, unlike nn.Linear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class FusedGateUpMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one packed product."""

    def __init__(self, kernels, mlp: nn.Module, quant: str | None = None):
        super().__init__()
        self.k = kernels
        g, u = mlp.gate_proj, mlp.up_proj
        self.inter = g.out_features
        w = torch.cat([g.weight.detach(), u.weight.detach()], 0)
        b = None if g.bias is None else torch.cat([g.bias.detach(), u.bias.detach()], 0)
        if w.dtype == torch.bfloat16:
            self.gate_up = PackedLinear(kernels, w, b, quant)
        else:  # float32: torch's own GEMM, one call instead of two
            self.gate_up = DenseLinear(w, b)
        self.down_proj = _packed_or_same(kernels, mlp.down_proj, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.k.silu_mul(self.gate_up(x)))


class FusedRMSNorm(nn.Module):
    def __init__(self, kernels, norm: nn.Module):
        super().__init__()
        self.k = kernels
        self.weight = norm.weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.dtype not in (torch.float32, torch.bfloat16):
            raise RuntimeError("FusedRMSNorm: dtype changed after the check")
        return self.k.rms_norm(x, self.weight, self.eps)


def _packed_or_same(kernels, lin: nn.Module, quant: str | None) -> nn.Module:
    if isinstance(lin, nn.Linear) and lin.weight.dtype == torch.bfloat16:
        return PackedLinear(kernels, lin.weight, lin.bias, quant)
    return lin


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Norm-wise: ||a - b|| <= rel * ||b||. A structurally different computation (another
    activation, swapped operands) misses by O(1); rounding differences by far less than rel."""
    a, b = a.float(), b.float()
    return bool(torch.isfinite(a).all()) and float((a - b).norm()) <= rel * float(b.norm()) + 1e-6


def _probe(dim: int, dtype: torch.dtype, rows: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(rows, 1, dim, generator=g).to(dtype)


def _is_rmsnorm(m: nn.Module) -> bool:
    return ("RMSNorm" in type(m).__name__ and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1 and (hasattr(m, "variance_epsilon") or hasattr(m, "eps")))


def _acts_like_silu(act) -> bool:
    if not isinstance(act, nn.Module):
        return False
    t = torch.linspace(-6, 6, 97)
    try:
        return torch.equal(act(t), nn.functional.silu(t))
    except Exception:  # noqa: BLE001 - an activation that cannot take this probe is not SiLU
        return False


def _is_silu_mlp(m: nn.Module) -> bool:
    lins = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(m, "act_fn", None)
    return (all(isinstance(x, nn.Linear) for x in lins) and _acts_like_silu(act)
            and lins[0].weight.dtype in (torch.bfloat16, torch.float32) and lins[0].weight.shape == lins[1].weight.shape
            and (lins[0].bias is None) == (lins[1].bias is None))


@torch.inference_mode()
def apply(model: nn.Module, kernels, quant: str | None = None) -> FastPathReport:
    """Swap in the kernels where each one checks out. Returns what was swapped. With
    quant="int8", bf16 linear layers other than the output head are stored as int8."""
    if quant not in (None, "int8"):
        raise ValueError(f"quant must be None or 'int8', got {quant!r}")
    rep = FastPathReport(isa=kernels.isa(), quant=quant)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    _walk(kernels, model, "", rep, quant, head)
    return rep


def _walk(kernels, mod: nn.Module, prefix: str, rep: FastPathReport, quant, head) -> None:
    for cname, child in list(mod.named_children()):
        full = f"{prefix}.{cname}" if prefix else cname
        try:
            new = _swap(kernels, child, full, rep, None if child is head else quant)
        except Exception as e:  # noqa: BLE001 - a module the probe cannot drive stays as it is
            log.debug("fast path: %s kept (%s)", full, e)
            rep.kept.append(full)
            new = None
        if new is not None:
            setattr(mod, cname, new)
        else:
            _walk(kernels, child, full, rep, quant, head)


def _swap(kernels, child: nn.Module, full: str, rep: FastPathReport, quant: str | None) -> nn.Module | None:
    tol = 0.05 if quant else 0.01  # int8 weights: about 0.5 / 127 per weight, a few tenths of a percent out
    if _is_silu_mlp(child):
        x = _probe(child.gate_proj.in_features, child.gate_proj.weight.dtype)
        ref = child(x)
        new = FusedGateUpMLP(kernels, child, quant)
        if _close(new(x), ref, tol):
            rep.mlp += 1
            return new
        rep.kept.append(full)
        return None
    if _is_rmsnorm(child) and child.weight.dtype in (torch.float32, torch.bfloat16):
        x = _probe(child.weight.shape[0], child.weight.dtype)
        new = FusedRMSNorm(kernels, child)
        if _close(new(x), child(x), 0.01):
            rep.norm += 1
            return new
        rep.kept.append(full)
        return None
    if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
        x = _probe(child.in_features, torch.bfloat16)
        new = PackedLinear(kernels, child.weight, child.bias, quant)
        if _close(new(x), child(x), max(tol, 0.02)):
            rep.linear += 1
            return new
        rep.kept.append(full)
    return None
