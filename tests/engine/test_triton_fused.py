"""The fused GPU ops through Triton's interpreter on CPU: RMSNorm (engine/triton_norm.py) in both
forms against transformers' own modules, a module neither form reproduces kept; the rotary
embedding (engine/triton_rope.py) against transformers' `apply_rotary_pos_emb`, other layouts
left to it; and engines whose norms and rotary run through the kernels (and their attention
through the Triton kernels) decoding generate()'s tokens."""
import importlib

import pytest
import torch

from keyacc_ray.engine import triton_attention, triton_norm, triton_rope
from tests.conftest import tiny_model
from tests.engine.test_decode_graphs import _generate_with_buckets
from tests.helpers import hf_greedy
from tests.engine.test_fast_path import _random_model

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpret():
    assert triton_attention.available(torch.device("cpu")), triton_attention.unavailable_reason()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cls,gemma", [("transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm", False),
                                       ("transformers.models.llama.modeling_llama.LlamaRMSNorm", False),
                                       ("transformers.models.gemma.modeling_gemma.GemmaRMSNorm", True)])
@pytest.mark.parametrize("width", [64, 40, 1000])
def test_both_forms_reproduce_the_modules(cls, gemma, dtype, width):
    mod_name, name = cls.rsplit(".", 1)
    norm = getattr(importlib.import_module(mod_name), name)(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width) * 0.5 + (0.0 if gemma else 1.0))
    norm = norm.to(dtype)
    model = torch.nn.Sequential(norm)
    assert triton_norm.fuse_rms_norms(model, torch.device("cpu"), dtype) == {"fused": 1, "kept": 0}
    x = (torch.randn((7, 3, width)) * 2).to(dtype)
    got = norm(x)  # now the kernel
    ref = type(norm).forward(norm, x)  # the class's own
    assert triton_norm._agrees(got, ref) and got.shape == ref.shape
    # the wrong form does not agree (the check that picks the form can tell them apart)
    assert not triton_norm._agrees(triton_norm.rms_norm(x, norm.weight, 1e-6, not gemma), ref)


def test_a_norm_neither_form_reproduces_keeps_its_forward():
    class OddRMSNorm(torch.nn.Module):  # a norm by another rule (no mean over the square)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(32))
            self.eps = 1e-6

        def forward(self, x):
            return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)

    odd = OddRMSNorm()
    assert triton_norm.fuse_rms_norms(torch.nn.Sequential(odd), torch.device("cpu"), torch.float32) == \
        {"fused": 0, "kept": 1}
    assert "forward" not in vars(odd)


def _modeling(arch: str):
    return importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim,cos_batch", [(16, 2), (64, 1), (40, 2)])
def test_rope_is_transformers_arithmetic(dtype, dim, cos_batch):
    """The models' layout (q / k as transposed views), cos / sin per batch row or shared: the same
    values as transformers' expression (float16: its roundings, so to the bit but for FMA)."""
    apply = _modeling("llama").apply_rotary_pos_emb
    g = torch.Generator().manual_seed(dim)
    q = torch.randn((2, 5, 6, dim), generator=g).to(dtype).transpose(1, 2)
    k = torch.randn((2, 5, 2, dim), generator=g).to(dtype).transpose(1, 2)
    ang = torch.randn((cos_batch, 5, dim // 2), generator=g) * 4
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(dtype) for f in (torch.cos, torch.sin))
    ref = apply(q, k, cos, sin)
    for x, r in zip(ref, (triton_rope.rope(q, cos, sin), triton_rope.rope(k, cos, sin))):
        assert r.stride() == x.stride() or r.is_contiguous() == x.is_contiguous()
        assert triton_norm._agrees(r, x) and float((r.float() - x.float()).abs().max()) <= 2e-3


def test_fuse_rotary_routes_the_usual_layout_and_leaves_the_rest(monkeypatch):
    m = _modeling("qwen3")
    monkeypatch.setattr(m, "apply_rotary_pos_emb", m.apply_rotary_pos_emb)  # restored after the test
    orig = m.apply_rotary_pos_emb
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = transformers.Qwen3ForCausalLM(cfg)
    calls = []
    monkeypatch.setattr(triton_rope, "rope", lambda x, c, s, _r=triton_rope.rope: calls.append(1) or _r(x, c, s))
    assert triton_rope.fuse_rotary(model, torch.device("cpu"), torch.float32) == "fused"
    assert m.apply_rotary_pos_emb is not orig and m.apply_rotary_pos_emb._keyacc_original is orig
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    calls.clear()
    m.apply_rotary_pos_emb(q, k, cos, sin)
    assert len(calls) == 2
    calls.clear()  # another layout ([batch, tokens, heads, dim], unsqueeze_dim 2): the original's
    got = m.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    ref = orig(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    assert not calls and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_fuse_rotary_in_bf16_and_the_reason_a_wrong_kernel_is_kept(monkeypatch):
    """bf16 at a real head size: the kernel is taken though the interpreter rounds to bf16 by
    truncation (a step of either product, where the two nearly cancel, is many steps of their sum:
    the check's yardstick is the products' size); a kernel that rotates wrongly is refused and the
    runner is told why (the H200 run reported only False)."""
    m = _modeling("qwen3")
    monkeypatch.setattr(m, "apply_rotary_pos_emb", m.apply_rotary_pos_emb)  # restored after the test
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    model = transformers.Qwen3ForCausalLM(cfg)
    orig = m.apply_rotary_pos_emb
    real = triton_rope.rope
    monkeypatch.setattr(triton_rope, "rope", lambda x, c, s: real(x, c, -s))  # the other direction
    got = triton_rope.fuse_rotary(model, torch.device("cpu"), torch.bfloat16)
    assert got.startswith("kept: q/k off by") and m.apply_rotary_pos_emb is orig
    monkeypatch.setattr(triton_rope, "rope", real)
    assert triton_rope.fuse_rotary(model, torch.device("cpu"), torch.bfloat16) == "fused"
    assert m.apply_rotary_pos_emb._keyacc_original is orig


@pytest.mark.parametrize("arch", ["qwen3", "gemma"])
def test_engine_with_fused_ops_decodes_like_generate(monkeypatch, tmp_path, arch):
    """Every layer's q/k/v and gate/up projections as one product each, every RMSNorm of the model
    (Qwen3's q and k norms included; Gemma's 1 + w form) and its rotary embedding through the
    kernels, attention through the Triton kernels, decode steps at bucket sizes: generate()'s tokens."""
    m = _modeling(arch)
    monkeypatch.setattr(m, "apply_rotary_pos_emb", m.apply_rotary_pos_emb)  # restored after the test
    monkeypatch.setenv("KEYACC_GPU_FUSE", "triton")
    monkeypatch.setenv("KEYACC_DECODE_ATTENTION", "triton")
    path = tiny_model("qwen3") if arch == "qwen3" else _random_model(tmp_path, "GemmaConfig", head_dim=16)
    calls = []
    real = triton_rope.rope
    monkeypatch.setattr(triton_rope, "rope", lambda *a: calls.append(1) or real(*a))
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((9, 3, 6))]
    max_tokens = [6, 8, 5]
    # generate()'s tokens first: once the engine loads, this process's model of that architecture
    # would rotate through the kernel too
    refs = [hf_greedy(path, p, mt) for p, mt in zip(prompts, max_tokens)]
    eng, outs, _ = _generate_with_buckets(path, prompts, max_tokens, kv_block_size=4)
    fused = eng.runner.fused_ops
    n_norms = sum(type(x).__name__.endswith("RMSNorm") for x in eng.runner.model.modules())
    layers = eng.runner.model.config.num_hidden_layers
    assert fused == {"projections": 2 * layers, "rms_norm": {"fused": n_norms, "kept": 0}, "rotary": "fused"}
    assert n_norms >= 3
    assert calls  # the steps' rotary went through the kernel
    assert outs == refs


def test_off_on_cpu_unless_forced(qwen3_path):
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2, max_model_len=64, cpu_kernels="off"))
    assert eng.runner.fused_ops is None
    assert not any("forward" in vars(m) for m in eng.runner.model.modules() if type(m).__name__.endswith("RMSNorm"))
