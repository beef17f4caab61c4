"""Continuous batching is token-identical to transformers' generate(), in float32."""
import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams

from tests.helpers import PROMPTS, hf_greedy


@pytest.mark.parametrize("arch_fixture", ["qwen3_path", "llama_path", "qwen2_path", "mistral_path"])
def test_continuous_batch_matches_generate(arch_fixture, request):
    path = request.getfixturevalue(arch_fixture)
    eng = LLMEngine(EngineConfig(model=path, max_num_seqs=8, dtype="float32"))
    # 18 mixed-length prompts, varied output lengths, joining at different steps; only 8 slots,
    # so requests also leave and new ones take their slots mid-run.
    reqs = [(f"r{i}", eng.tokenize(p), 5 + (i * 7) % 23) for i, p in enumerate(PROMPTS)]
    outs = {rid: [] for rid, _, _ in reqs}
    pending = list(reqs)
    step = 0
    max_batch = 0
    while pending or eng.has_unfinished():
        if pending and step % 2 == 0:  # two new requests every other step
            for rid, ids, n in pending[:2]:
                eng.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            pending = pending[2:]
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
        max_batch = max(max_batch, eng.scheduler.num_running)
        step += 1
        assert step < 2000
    assert max_batch == 8  # the decode really ran batched
    for rid, ids, n in reqs:
        assert outs[rid] == hf_greedy(path, ids, n), rid


def test_eos_ends_sequence_like_generate(qwen3_path):
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4))
    prompts = [eng.tokenize(p) for p in PROMPTS[:6]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    for ids, out in zip(prompts, outs):
        assert out == hf_greedy(qwen3_path, ids, 40, stop_at_eos=True)
