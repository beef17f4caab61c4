"""The fused RMSNorm (engine/triton_norm.py) through Triton's interpreter on CPU: both forms
against transformers' own modules, a module neither form reproduces kept, and an engine whose
norms all run through the kernel (and its attention through the Triton kernels) decoding
generate()'s tokens."""
import pytest
import torch

from keyacc_ray.engine import triton_attention, triton_norm
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
    import importlib

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


@pytest.mark.parametrize("arch", ["qwen3", "gemma"])
def test_engine_with_fused_norms_decodes_like_generate(monkeypatch, tmp_path, arch):
    """Every RMSNorm of the model (Qwen3's q and k norms included; Gemma's 1 + w form) through the
    kernel, attention through the Triton kernels, decode steps at bucket sizes: generate()'s tokens."""
    monkeypatch.setenv("KEYACC_GPU_NORM", "triton")
    monkeypatch.setenv("KEYACC_DECODE_ATTENTION", "triton")
    path = tiny_model("qwen3") if arch == "qwen3" else _random_model(tmp_path, "GemmaConfig", head_dim=16)
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((9, 3, 6))]
    max_tokens = [6, 8, 5]
    eng, outs, _ = _generate_with_buckets(path, prompts, max_tokens, kv_block_size=4)
    fused = eng.runner.fused_norms
    n_norms = sum(type(m).__name__.endswith("RMSNorm") for m in eng.runner.model.modules())
    assert fused == {"fused": n_norms, "kept": 0} and n_norms >= 3
    for p, m, out in zip(prompts, max_tokens, outs):
        assert out == hf_greedy(path, p, m)


def test_off_on_cpu_unless_forced(qwen3_path):
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2, max_model_len=64, cpu_kernels="off"))
    assert eng.runner.fused_norms is None
    assert not any("forward" in vars(m) for m in eng.runner.model.modules() if type(m).__name__.endswith("RMSNorm"))
