"""Architectures beyond the four the project builds models for: what the cache must hold is read
from the model (a probe forward), not from config names, so GQA under other attribute names
(Falcon), keys and values of different sizes (DeepSeek's multi-head latent attention caches its latent) and
eager-only attention (Gemma2's soft-capping) decode exactly like generate(), also across a KV
hand-off between two engines. Models with state other than attention KV are refused at load."""
import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.errors import ModelLoadError
from tests.engine.test_fast_path import _random_model
from tests.helpers import hf_greedy

ARCHS = [
    # GQA heads under another config name: the cache holds what the layers really pass (4 heads)
    ("FalconConfig", {"num_kv_heads": 2, "new_decoder_architecture": True}, (4, 16, 16)),
    # multi-head latent attention: transformers caches one latent "head" (kv_lora_rank 16) as the
    # keys and the shared rope key (8) as the values: differently sized, read from the model
    ("DeepseekV3Config", {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 32, "first_k_dense_replace": 1, "q_lora_rank": None,
                          "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 24,
                          "n_group": 1, "topk_group": 1}, (1, 16, 8)),
    # no SDPA path (logit soft-capping): its eager attention, sliding window on alternate layers
    ("Gemma2Config", {"head_dim": 16, "sliding_window": 8}, (2, 16, 16)),
    ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, (2, 16, 16)),
]


@pytest.mark.parametrize("cls,kw,dims", ARCHS, ids=[a[0] for a in ARCHS])
def test_other_architectures_decode_and_hand_off_like_generate(tmp_path, cls, kw, dims):
    path = _random_model(tmp_path, cls, **kw)
    a = LLMEngine(EngineConfig(model=path, max_num_seqs=8, dtype="float32", max_model_len=256))
    s = a.runner.kv_shape
    assert (s.num_kv_heads, s.head_dim, s.v_dim) == dims
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((14, 12, 13, 3))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    refs = [hf_greedy(path, p, 12) for p in prompts]
    assert a.generate(prompts, params) == refs
    # four tokens here, the rest on a second engine from the exported KV
    b = LLMEngine(EngineConfig(model=path, max_num_seqs=8, dtype="float32", max_model_len=256))
    a.add_request("h", prompts[0], params)
    got = []
    while len(got) < 4:
        got += [t for o in a.step() for t in o.new_token_ids]
    pkg = a.export_request("h")
    assert pkg.meta.dims == (s.num_layers, *dims) and pkg.meta.num_kv_tokens == len(prompts[0]) + 3
    b.import_request(pkg)
    while b.has_unfinished():
        got += [t for o in b.step() for t in o.new_token_ids]
    assert got == refs[0]


def test_model_with_recurrent_state_is_refused_at_load(tmp_path):
    path = _random_model(tmp_path, "FalconH1Config")
    with pytest.raises(ModelLoadError, match="FalconH1ForCausalLM does not run on keyacc's KV cache"):
        LLMEngine(EngineConfig(model=path, max_num_seqs=2, dtype="float32", max_model_len=64))


def test_package_from_a_different_model_shape_is_refused(tmp_path, qwen3_path):
    mla = LLMEngine(EngineConfig(model=_random_model(tmp_path, ARCHS[1][0], **ARCHS[1][1]), max_num_seqs=2, dtype="float32",
                                 max_model_len=64))
    mla.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    mla.step()
    pkg = mla.export_request("x")
    other = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2))
    with pytest.raises(Exception, match="k_dim, v_dim"):
        other.import_request(pkg)


@pytest.mark.parametrize("cls,kw,dims", ARCHS, ids=[a[0] for a in ARCHS])
def test_other_architectures_hand_off_over_the_receivers_cached_head(tmp_path, cls, kw, dims):
    """A hand-off that leaves out the head its receiver caches (KVMeta.kv_start) lands on that
    head: MLA latents, sliding windows and soft-capped eager attention decode on like generate()."""
    path = _random_model(tmp_path, cls, **kw)
    cfg = dict(max_num_seqs=4, dtype="float32", max_model_len=256, kv_block_size=8)
    a, b = LLMEngine(EngineConfig(model=path, **cfg)), LLMEngine(EngineConfig(model=path, **cfg))
    head = list(range(40, 80))
    b.generate([head + [3, 4]], SamplingParams(max_tokens=2, temperature=0))  # b caches the head
    prompt = head + [9, 8, 7, 6, 5]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    a.add_request("h", prompt, params)
    got = []
    while len(got) < 3:
        got += [t for o in a.step() for t in o.new_token_ids]
    pkg = a.export_request("h", skip_tokens=len(head))
    assert pkg.meta.kv_start == len(head)
    b.import_request(pkg)
    while b.has_unfinished():
        got += [t for o in b.step() for t in o.new_token_ids]
    assert got == hf_greedy(path, prompt, 10)
    assert b.stats().kv_import_cached_tokens == len(head) and b.stats().kv_import_recomputed_tokens == 0
