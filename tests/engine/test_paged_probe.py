"""The load probe that decides whether the paged attention replaces the model's own (engine/runner.py
`_try_paged`): a relative error within the dtype's tolerance passes outright; past it, the yardstick
is how far two of the model's own attention implementations (SDPA and eager) are apart on the same
probe (deep bf16 models amplify rounding layer by layer: the 14B shape on the H200); a semantic
difference (here: the wrong softmax scale) is refused either way."""
import pytest
import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine import paged_attention, runner
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from tests.engine.test_fast_path import _random_model


@pytest.fixture(scope="module")
def bf16_deep(tmp_path_factory):
    return _random_model(tmp_path_factory.mktemp("deep"), "Qwen3Config", head_dim=16, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, torch_dtype="bfloat16")


def _engine(path):
    return LLMEngine(EngineConfig(model=path, dtype="bfloat16", device="cpu", cpu_kernels="off", max_num_seqs=2,
                                  max_model_len=128))


def test_within_tolerance_passes_outright(bf16_deep):
    eng = _engine(bf16_deep)
    err, floor = eng.runner.probe_error
    assert eng.runner.paged and max(err) <= runner.PROBE_TOL[None] and floor is None


def test_past_tolerance_the_models_own_implementations_are_the_yardstick(bf16_deep, monkeypatch):
    monkeypatch.setitem(runner.PROBE_TOL, None, 0.0)  # every rounding difference past the tolerance
    eng = _engine(bf16_deep)
    err, floor = eng.runner.probe_error
    assert floor is not None and len(floor) == len(err) == 3 and min(floor) > 0
    assert eng.runner.paged and all(e <= 2 * f for e, f in zip(err, floor))
    assert eng.runner.model.config._attn_implementation == paged_attention.ATTN_NAME
    # and it serves through the paged path, greedy as the model's own attention decides
    ref = _engine(bf16_deep)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert eng.generate([[5, 9, 11, 4]], [p])[0] == ref.generate([[5, 9, 11, 4]], [p])[0]


@pytest.mark.parametrize("tol", [None, 0.0])
def test_a_semantic_difference_is_refused(bf16_deep, monkeypatch, tol):
    """Paged attention with the softmax scale 1.5x off: refused with the tolerance as it is and at 0
    (both times past the yardstick too), and the model keeps its own attention."""
    if tol is not None:
        monkeypatch.setitem(runner.PROBE_TOL, None, tol)
    real = paged_attention.PagedAttention.__call__

    def off(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        scaling = (scaling if scaling is not None else query.shape[-1] ** -0.5) * 1.5
        return real(self, module, query, key, value, attention_mask, dropout, scaling, **kw)

    monkeypatch.setattr(paged_attention.PagedAttention, "__call__", off)
    eng = _engine(bf16_deep)
    err, floor = eng.runner.probe_error
    assert not eng.runner.paged and max(err) > runner.PROBE_TOL[None]
    assert eng.runner.model.config._attn_implementation != paged_attention.ATTN_NAME
    assert floor is not None and max(err) > 2 * max(floor)  # (past the tolerance: the yardstick was asked)
