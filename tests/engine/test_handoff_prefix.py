"""Hand-offs over the prefix cache: an import shares the head its engine caches (those bytes of the
package are not copied), an export may leave that head out (`skip_tokens`, KVMeta.kv_start), and an
importer that lacks what was left out computes the sequence again from what it holds. Tokens are
transformers' generate() on every path."""
import pickle

import numpy as np
import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.errors import InvalidRequest
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from tests.helpers import hf_greedy

HEAD = [(37 * k + 11) % 400 + 5 for k in range(40)]  # a shared head ("system prompt") of 40 tokens
N = 12


def _engine(path, bs, **cfg):
    return LLMEngine(EngineConfig(model=path, max_num_seqs=4, dtype="float32", kv_block_size=bs, **cfg))


def _drain(eng, rid=None):
    got = []
    while eng.has_unfinished():
        got += [t for o in eng.step() for t in o.new_token_ids if rid is None or o.request_id == rid]
    return got


def _cache(eng, prompt):
    """Run a prompt there to the end: its blocks stay cached."""
    eng.add_request(f"seed{len(eng.seqs)}-{len(prompt)}", prompt, SamplingParams(max_tokens=2, temperature=0))
    _drain(eng)


def _handoff(src, dst, prompt, k=3, skip=0, layout=None):
    """`prompt` on src for k tokens, exported (leaving out `skip` tokens' K/V where whole blocks),
    pickled as it crosses processes, imported into dst and finished there."""
    src.add_request("x", prompt, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    got = []
    while len(got) < k:
        got += [t for o in src.step() for t in o.new_token_ids]
    pkg = pickle.loads(pickle.dumps(src.export_request("x", layout=layout, skip_tokens=skip)))
    dst.import_request(pkg)
    return got + _drain(dst, "x"), pkg


def _arrays_hold(pkg) -> int:
    return pkg.keys.shape[2 if pkg.meta.layout == "LHTD" else 1]


@pytest.mark.parametrize("layout", ["LHTD", "LTHD"])
@pytest.mark.parametrize("src_bs, dst_bs", [(4, 4), (16, 4), (4, 8)])
def test_a_handoff_leaves_out_the_head_its_receiver_caches(qwen3_path, layout, src_bs, dst_bs):
    src, dst = _engine(qwen3_path, src_bs), _engine(qwen3_path, dst_bs)
    _cache(dst, HEAD + [1, 2, 3])  # another conversation with the same head ran there
    prompt = HEAD + [50, 51, 52, 53, 54]
    got, pkg = _handoff(src, dst, prompt, skip=len(HEAD), layout=layout)
    assert got == hf_greedy(qwen3_path, prompt, N)
    assert pkg.meta.kv_start == len(HEAD) // src_bs * src_bs > 0
    assert _arrays_hold(pkg) == pkg.meta.num_kv_tokens - pkg.meta.kv_start == len(prompt) + 2 - pkg.meta.kv_start
    s, d = src.stats(), dst.stats()
    assert s.kv_export_skipped_tokens == pkg.meta.kv_start
    assert d.kv_import_cached_tokens == len(HEAD) // dst_bs * dst_bs >= pkg.meta.kv_start
    assert d.kv_import_recomputed_tokens == 0
    for e in (src, dst):  # nothing held once both are done
        assert e.blocks.num_free_blocks == e.blocks.num_blocks


@pytest.mark.parametrize("dst_cfg, seeded, recomputed_from", [
    ({}, None, 0),  # the receiver caches nothing of it
    ({}, HEAD[:17], 16),  # a shorter head than what was left out: computed again from there
    ({"enable_prefix_caching": False}, HEAD + [1], 0),  # no prefix cache: computed again whole
])
def test_a_handoff_whose_left_out_head_its_receiver_lacks_is_computed_again(qwen3_path, dst_cfg, seeded,
                                                                             recomputed_from):
    src, dst = _engine(qwen3_path, 4), _engine(qwen3_path, 4, **dst_cfg)
    if seeded:
        _cache(dst, seeded)
    prompt = HEAD + [60, 61, 62]
    got, pkg = _handoff(src, dst, prompt, k=4, skip=len(HEAD))
    assert pkg.meta.kv_start == len(HEAD)
    assert got == hf_greedy(qwen3_path, prompt, N)
    d = dst.stats()
    assert d.kv_import_recomputed_tokens == pkg.meta.num_kv_tokens - recomputed_from
    assert d.kv_import_cached_tokens == 0
    assert dst.blocks.num_free_blocks == dst.blocks.num_blocks


def test_a_full_package_lands_on_the_cached_head_and_takes_fewer_blocks(qwen3_path):
    """Without a skip the package holds every token; the receiver still shares the head it
    caches (its blocks are the cached ones, not new copies) and writes only the rest."""
    src, dst = _engine(qwen3_path, 4), _engine(qwen3_path, 4)
    _cache(dst, HEAD + [7])
    cached_blocks = dst.blocks.num_cached_blocks
    prompt = HEAD + [70, 71]
    src.add_request("x", prompt, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    got = [t for o in src.step() for t in o.new_token_ids]
    pkg = src.export_request("x")
    assert pkg.meta.kv_start == 0 and _arrays_hold(pkg) == len(prompt)
    dst.import_request(pkg)
    got += [t for o in dst.step() for t in o.new_token_ids]
    head_blocks = dst.blocks.table_ref("x")[:len(HEAD) // 4]
    assert all(dst.blocks._ref[b] == 1 and b in dst.blocks._key_of for b in head_blocks)  # the cached ones
    assert dst.blocks.num_cached_blocks == cached_blocks  # nothing of the head keyed twice
    got += _drain(dst, "x")
    assert got == hf_greedy(qwen3_path, prompt, N)
    assert dst.stats().kv_import_cached_tokens == len(HEAD)


def test_a_package_whose_arrays_do_not_hold_its_span_is_refused(qwen3_path):
    src, dst = _engine(qwen3_path, 4), _engine(qwen3_path, 4)
    src.add_request("x", HEAD, SamplingParams(max_tokens=N, temperature=0))
    while not any(o.new_token_ids for o in src.step()):
        pass
    pkg = src.export_request("x", skip_tokens=8)
    for bad in ({"kv_start": pkg.meta.num_kv_tokens + 4}, {"kv_start": 4}, {"num_kv_tokens": len(pkg.token_ids) + 1}):
        broken = pickle.loads(pickle.dumps(pkg))
        for k, v in bad.items():
            setattr(broken.meta, k, v)
        with pytest.raises(InvalidRequest, match="do not hold"):
            dst.import_request(broken)
    short = pickle.loads(pickle.dumps(pkg))
    short.keys = np.ascontiguousarray(short.keys[:, :, 1:])
    with pytest.raises(InvalidRequest, match="do not hold"):
        dst.import_request(short)
    assert not dst.has_unfinished()
