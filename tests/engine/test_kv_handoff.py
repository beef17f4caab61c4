"""Export after k generated tokens, import into a differently configured engine, continue."""
import pickle

import numpy as np
import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from tests.helpers import PROMPTS, hf_greedy

N_NEW = 24


def run_until(eng, rid, k, outs=None):
    """Step until `rid` has generated k tokens (k=0: not even admitted); every request's
    tokens are collected in `outs`."""
    outs = {} if outs is None else outs
    while len(outs.get(rid, [])) < k:
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return outs.get(rid, [])


def drain(eng, outs=None):
    outs = {} if outs is None else outs
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return outs


@pytest.mark.parametrize("k", [0, 1, 5, 17])
@pytest.mark.parametrize("layout", ["LHTD", "LTHD"])
def test_export_import_continues_token_identically(qwen3_path, k, layout):
    src = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, kv_block_size=16, kv_export_layout=layout))
    dst = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=6, kv_block_size=4, max_model_len=512))
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    prompts = {f"p{i}": src.tokenize(PROMPTS[i]) for i in (1, 3, 8)}
    for rid, ids in prompts.items():
        src.add_request(rid, ids, params)
    # other traffic on the destination, so the import joins a running batch
    dst.add_request("other", dst.tokenize(PROMPTS[5]), params)
    other_first = [t for o in dst.step() for t in o.new_token_ids]
    src_outs = {}
    first = run_until(src, "p3", k, src_outs)
    pkg = src.export_request("p3")
    assert pkg.meta.layout == layout and pkg.meta.num_kv_tokens == (len(prompts["p3"]) + k - 1 if k else 0)
    assert isinstance(pkg.keys, np.ndarray) and pkg.keys.dtype == np.float32
    pkg = pickle.loads(pickle.dumps(pkg))  # it crosses a process boundary in real use
    dst.import_request(pkg)
    rest = drain(dst)
    src_rest = drain(src, src_outs)
    assert first + rest["p3"] == hf_greedy(qwen3_path, prompts["p3"], N_NEW)
    assert other_first + rest["other"] == hf_greedy(qwen3_path, dst.tokenize(PROMPTS[5]), N_NEW)
    for rid in ("p1", "p8"):  # the exporter's other sequences are unaffected (slot compaction)
        assert src_rest[rid] == hf_greedy(qwen3_path, prompts[rid], N_NEW)


def test_an_engine_whose_waiting_queue_is_full_still_takes_a_stream_under_way(qwen3_path):
    """A fresh prompt past `max_waiting` is refused (a clear 503 upstream); a hand-off of a stream
    whose client has tokens is not (refused, its client's stream was cut mid-way): it queues past
    the bound, ahead of the fresh prompts, and continues token-identically."""
    from keyacc_ray.errors import Overloaded

    src = LLMEngine(EngineConfig(model=qwen3_path))
    dst = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=1, max_waiting=2))
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    ids = src.tokenize(PROMPTS[3])
    src.add_request("p3", ids, params)
    first = run_until(src, "p3", 5)
    pkg = src.export_request("p3")
    for i in range(3):  # one runs, two wait: the queue is full
        dst.add_request(f"f{i}", dst.tokenize(PROMPTS[i]), params)
        dst.step()
    with pytest.raises(Overloaded):
        dst.add_request("f3", dst.tokenize(PROMPTS[4]), params)
    s = dst.stats()  # what the router reads to send no more there (policies: PoolLoad.refuses_new)
    assert (s.num_waiting, s.max_waiting) == (2, 2)
    dst.import_request(pkg)
    assert [s.request_id for s in dst.scheduler.waiting][0] == "p3"
    rest = drain(dst)
    assert first + rest["p3"] == hf_greedy(qwen3_path, ids, N_NEW)


@pytest.mark.parametrize("under_way", [2, 0])
def test_streams_under_way_take_places_past_max_num_seqs_and_fresh_prompts_do_not(qwen3_path, under_way):
    """Streams moved here mid-stream (a failover moves a dead replica's streams at once) run past
    `max_num_seqs` by up to `max_num_seqs_under_way` (off by default) instead of waiting for
    places; a fresh prompt waits for a place within max_num_seqs. Off: the cap holds for every
    sequence. Token-identical either way."""
    src = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8))
    dst = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2, max_num_seqs_under_way=under_way))
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    moved = {f"m{i}": src.tokenize(PROMPTS[i]) for i in (1, 3, 8)}
    for rid, ids in moved.items():
        src.add_request(rid, ids, params)
    src_outs: dict = {}
    for rid in moved:
        run_until(src, rid, 3, src_outs)
    fresh = {f"f{i}": dst.tokenize(PROMPTS[i]) for i in (2, 5, 6)}
    outs: dict = {}
    for rid in ("f2", "f5"):
        dst.add_request(rid, fresh[rid], params)
    for o in dst.step():
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid in moved:
        dst.import_request(src.export_request(rid))
    dst.add_request("f6", fresh["f6"], params)
    for o in dst.step():
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    running = {s.request_id for s in dst.scheduler.running}
    if under_way:  # two places more, for two of the three moved streams; f6 waits
        assert running == {"f2", "f5", "m1", "m3"} and [s.request_id for s in dst.scheduler.waiting] == ["m8", "f6"]
    else:
        assert running == {"f2", "f5"}
    drain(dst, outs)
    for rid, ids in moved.items():
        assert src_outs[rid] + outs[rid] == hf_greedy(qwen3_path, ids, N_NEW)
    for rid, ids in fresh.items():
        assert outs[rid] == hf_greedy(qwen3_path, ids, N_NEW)


def test_seeded_sampling_state_travels(qwen3_path):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    ref = LLMEngine(EngineConfig(model=qwen3_path)).generate([PROMPTS[0]], params)[0]
    a = LLMEngine(EngineConfig(model=qwen3_path))
    b = LLMEngine(EngineConfig(model=qwen3_path, kv_block_size=8))
    a.add_request("s", PROMPTS[0], params)
    first = run_until(a, "s", 6)
    b.import_request(a.export_request("s"))
    assert first + drain(b)["s"] == ref


def test_import_rejects_other_model_shape(qwen3_path, llama_path):
    a = LLMEngine(EngineConfig(model=qwen3_path))
    b = LLMEngine(EngineConfig(model=llama_path))
    a.add_request("x", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))
    run_until(a, "x", 1)
    pkg = a.export_request("x")
    if (pkg.meta.num_layers, pkg.meta.num_kv_heads, pkg.meta.head_dim) != (
            b.runner.kv_shape.num_layers, b.runner.kv_shape.num_kv_heads, b.runner.kv_shape.head_dim):
        with pytest.raises(Exception, match="cannot continue"):
            b.import_request(pkg)
    else:  # same shapes: it imports (the model id is informational)
        b.import_request(pkg)
