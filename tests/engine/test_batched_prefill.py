"""A step's fresh prompts prefilled in one left-padded forward: the same tokens as transformers'
generate() for each prompt alone, on every architecture, sliding windows included."""
import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine, prefill_groups
from keyacc_ray.engine.request import SamplingParams
from tests.engine.test_fast_path import _random_model
from tests.helpers import hf_greedy


def test_groups_bound_the_padding():
    assert prefill_groups([]) == []
    assert prefill_groups([7]) == [[0]]
    # 20, 20, 19, 17 pad to 80 for 76 real tokens: one group; 3 would pad 100 for 79 real
    assert prefill_groups([17, 20, 3, 19, 20]) == [[1, 4, 3, 0], [2]]
    assert prefill_groups([100, 10, 10, 10]) == [[0], [1, 2, 3]]
    groups = prefill_groups([5, 50, 9, 48, 47, 12, 11, 6, 49])
    assert sorted(i for g in groups for i in g) == list(range(9))
    lens = [5, 50, 9, 48, 47, 12, 11, 6, 49]
    for g in groups:
        assert len(g) * max(lens[i] for i in g) <= 1.25 * sum(lens[i] for i in g)


def _run_batched(path: str, prompts: list[list[int]], n: int, **cfg) -> tuple[list[list[int]], list[int]]:
    eng = LLMEngine(EngineConfig(model=path, max_num_seqs=16, dtype="float32", **cfg))
    rows = []
    real = eng.runner.prefill
    eng.runner.prefill = lambda ids, ps: rows.append(len(ids)) or real(ids, ps)
    outs = eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return outs, rows


@pytest.mark.parametrize("arch_fixture", ["qwen3_path", "llama_path", "qwen2_path", "mistral_path"])
def test_batched_prefill_matches_generate(arch_fixture, request):
    path = request.getfixturevalue(arch_fixture)
    # lengths 17-24: one padded forward (offsets up to 7) for all eight
    prompts = [[(31 * i + 7 * k) % 400 + 10 for k in range(17 + i)] for i in range(8)]
    outs, rows = _run_batched(path, prompts, 12)
    assert rows == [8]
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(path, p, 12)


@pytest.mark.parametrize("cls,kw", [
    # a sliding window shorter than the prompts, on alternate layers (layer_types)
    ("Qwen3Config", {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                     "use_sliding_window": True}),
    ("MistralConfig", {"head_dim": 16, "sliding_window": 6}),
    ("GemmaConfig", {"head_dim": 16}),
])
def test_batched_prefill_matches_generate_other_architectures(tmp_path, cls, kw):
    path = _random_model(tmp_path, cls, **kw)
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((14, 12, 13, 11))]
    outs, rows = _run_batched(path, prompts, 16)
    assert rows == [4]
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(path, p, 16)


def test_off_prefills_one_forward_each(qwen3_path):
    prompts = [[10 + k for k in range(20)], [20 + k for k in range(19)]]
    outs, rows = _run_batched(qwen3_path, prompts, 6, batched_prefill=False)
    assert rows == []
    assert outs == [hf_greedy(qwen3_path, p, 6) for p in prompts]
