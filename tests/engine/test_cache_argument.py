"""The KV cache reaches the model under the argument name its forward takes.

transformers 5.2x names it `cache`; earlier 5.x (the GPU host's 5.17) and remote-code models name
it `past_key_values`. Passed under the wrong name it lands in **kwargs unused: the model attends
over the current token alone and decodes fluent garbage with no error. Found on the GPU host.
"""
import pytest
import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.engine.runner import cache_kwarg
from keyacc_ray.errors import ModelLoadError
from tests.helpers import hf_greedy


class OldNaming(torch.nn.Module):
    """The model as an older transformers presents it: the cache comes as `past_key_values`."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.kw = inner, inner.config, cache_kwarg(inner)

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                          use_cache=use_cache, logits_to_keep=logits_to_keep, **{self.kw: past_key_values})


class IgnoresCache(OldNaming):
    """Takes the cache under a name the runner does not know and drops it."""

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, kv=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        return self.inner(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          logits_to_keep=logits_to_keep)


@pytest.fixture(scope="module")
def engine(qwen3_path):
    return LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4))


def test_the_installed_transformers_names_the_argument(engine):
    assert cache_kwarg(engine.runner.model) in ("cache", "past_key_values")
    assert cache_kwarg(OldNaming(engine.runner.model)) == "past_key_values"


def test_a_model_taking_past_key_values_decodes_like_generate(engine, qwen3_path):
    runner = engine.runner
    inner, fused, kw = runner.model, runner.fused_step, runner._cache_kw
    try:
        runner.model, runner.fused_step = OldNaming(inner), None  # every step through the forward
        runner._cache_kw = cache_kwarg(runner.model)
        runner._check_cache_used()
        prompt = engine.tokenize("the cache must reach every layer")
        out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    finally:
        runner.model, runner.fused_step, runner._cache_kw = inner, fused, kw
    assert out == hf_greedy(qwen3_path, prompt, 12)


def test_a_model_that_drops_the_cache_is_refused_at_load(engine):
    runner = engine.runner
    inner, kw = runner.model, runner._cache_kw
    try:
        runner.model = IgnoresCache(inner)
        with pytest.raises(ModelLoadError, match="did not write the KV cache"):
            runner._check_cache_used()
        with pytest.raises(ModelLoadError, match="no KV cache argument"):
            cache_kwarg(torch.nn.Linear(2, 2))
    finally:
        runner.model, runner._cache_kw = inner, kw
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # the probe holds no block
