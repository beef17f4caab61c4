"""Projections that read the same input as one product (engine/fused_linear.py): the parts give
each projection's output, the weights are held once, a part called on another input runs the
product itself, groups that cannot be fused are left apart."""
import torch

from keyacc_ray.engine import fused_linear


class Attn(torch.nn.Module):
    def __init__(self, bias: bool, k_in: int = 32):
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 48, bias=bias)
        self.k_proj = torch.nn.Linear(k_in, 16, bias=bias)
        self.v_proj = torch.nn.Linear(32, 16, bias=bias)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(32, 64, bias=False)
        self.up_proj = torch.nn.Linear(32, 64, bias=False)
        self.down_proj = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_groups_give_the_same_outputs_with_the_weights_once():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attn": Attn(bias=True), "mlp": MLP()})
    x = torch.randn(2, 5, 32)
    ref = {n: getattr(model["attn"], n)(x) for n in ("q_proj", "k_proj", "v_proj")}
    ref_mlp = model["mlp"](x)
    before = _params(model)
    assert fused_linear.fuse_projections(model) == 2
    assert _params(model) == before  # one copy of the weights, counted once
    parts = [model["attn"].q_proj, model["attn"].k_proj, model["attn"].v_proj]
    assert all(isinstance(p, fused_linear.FusedPart) for p in parts)
    calls = []
    real = torch.nn.functional.linear
    torch.nn.functional.linear = lambda *a: calls.append(1) or real(*a)
    try:
        got = {n: getattr(model["attn"], n)(x) for n in ("q_proj", "k_proj", "v_proj")}
        assert len(calls) == 1  # one product for the three
        other = torch.randn(2, 5, 32)
        assert torch.allclose(model["attn"].v_proj(other), real(other, *_wb(parts, 2)), atol=1e-6)
        assert len(calls) == 2  # another input: its own product
    finally:
        torch.nn.functional.linear = real
    for n in ref:
        assert got[n].shape == ref[n].shape and torch.allclose(got[n], ref[n], atol=1e-5)
    assert torch.allclose(model["mlp"](x), ref_mlp, atol=1e-5)


def _wb(parts, i):
    p = parts[i]
    return p.weight[p.lo:p.hi], p.bias[p.lo:p.hi]


def test_groups_that_cannot_be_fused_are_left_apart():
    model = torch.nn.ModuleDict({"a": Attn(bias=False, k_in=24)})  # k reads another width
    assert fused_linear.fuse_projections(model) == 0
    assert type(model["a"].q_proj) is torch.nn.Linear


def test_a_product_is_let_go_once_every_part_took_its_slice():
    """No step's activations outlive it: after q, k and v took theirs the group holds neither the
    input nor the product (held, a 14B model's 8k-token products filled the device); the same input
    projected again runs a new product; a product some part never took is replaced, not kept."""
    torch.manual_seed(1)
    model = torch.nn.ModuleDict({"attn": Attn(bias=False), "mlp": MLP()})
    assert fused_linear.fuse_projections(model) == 2
    q, k, v = (getattr(model["attn"], n) for n in ("q_proj", "k_proj", "v_proj"))
    product = q._product
    x = torch.randn(3, 32)
    ref = torch.nn.functional.linear(x, q.weight)
    q(x)
    assert product.y is not None and product.x is x  # k and v still to take theirs
    k(x)
    out = v(x)
    assert product.x is None and product.y is None
    assert torch.allclose(out, ref[:, 64:], atol=1e-6)  # the slice outlives the group's hold
    assert torch.allclose(q(x), ref[:, :48], atol=1e-6)  # again: a new product
    y = torch.randn(3, 32)
    assert torch.allclose(k(y), torch.nn.functional.linear(y, q.weight)[:, 48:64], atol=1e-6)
    assert product.x is y  # the one q ran on x and left untaken is gone
    model["mlp"](x)
    assert model["mlp"].gate_proj._product.y is None
