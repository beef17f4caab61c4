"""Admission under a KV budget, seeded sampling, stops, streaming text, bad parameters."""
import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.errors import InvalidRequest, ModelLoadError
from tests.helpers import PROMPTS, hf_greedy


@pytest.fixture(scope="module")
def engine(qwen3_path):
    return LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=16))


def _run_all(eng, prompts, params) -> tuple[dict, int]:
    """Every prompt as request r<i> to the end: outputs by request, and the most running at once."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    outs, peak = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        peak = max(peak, eng.scheduler.num_running)
        assert eng.blocks.num_free_blocks >= 0
    return outs, peak


def test_reserved_budget_for_n_sequences_admits_at_most_n(qwen3_path):
    n, block, max_tokens = 4, 8, 20
    # every request below needs ceil((prompt<=28 + 20) / 8) <= 6 blocks; budget: n of them (the
    # prompts repeat: without prefix caching, which would share their blocks)
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=32, kv_block_size=block, num_kv_blocks=6 * n,
                                 kv_allocation="reserve", enable_prefix_caching=False))
    prompts = [eng.tokenize(p)[:28] for p in PROMPTS[: n + 5]]
    assert all(eng.blocks.blocks_for(len(p) + max_tokens) == 6 for p in prompts if len(p) > 20)
    prompts = [p for p in prompts if len(p) > 20] or prompts
    prompts = (prompts * (n + 5))[: n + 5]
    outs, peak = _run_all(eng, prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert peak == n
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(qwen3_path, p, max_tokens)


def test_context_is_capped_by_the_kv_budget(qwen3_path):
    """A budget smaller than the model's context caps the context served: the longest request
    the engine can ever admit, so a request of the full served length runs instead of being
    refused as too big for the budget."""
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, kv_block_size=16, num_kv_blocks=4,
                                 max_model_len=256))
    assert eng.max_model_len == 64
    prompt = eng.tokenize(PROMPTS[0])[:10]
    with pytest.raises(InvalidRequest) as e:
        eng.add_request("long", prompt, SamplingParams(max_tokens=64 - len(prompt) + 1))
    assert e.value.code == "context_length_exceeded"
    params = SamplingParams(max_tokens=64 - len(prompt), temperature=0, ignore_eos=True)
    assert eng.generate([prompt], params)[0] == hf_greedy(qwen3_path, prompt, 64 - len(prompt))
    # a budget that holds the whole context leaves it alone
    assert LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2, num_kv_blocks=16, max_model_len=256)).max_model_len == 256


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([PROMPTS[3]], params)[0]
    mixed = engine.generate([PROMPTS[0], PROMPTS[3], PROMPTS[5]],
                            [SamplingParams(max_tokens=30, temperature=0.7, seed=1), params,
                             SamplingParams(max_tokens=5, temperature=0)])[1]
    assert alone == mixed
    other_seed = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9,
                                                              top_k=50, seed=99))[0]
    assert other_seed != alone  # the seed matters (16 draws at temperature 1)


def run_text(engine, prompt, params):
    rid = f"t{id(params)}"
    engine.add_request(rid, prompt, params)
    text, toks, reason = "", [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                text += o.text
                toks += o.new_token_ids
                reason = o.finish_reason or reason
    return text, toks, reason


def test_stop_string_ends_sequence_and_is_not_emitted(engine):
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full_text, full_toks, reason = run_text(engine, PROMPTS[1], greedy)
    assert reason == "length" and full_text == engine.tokenizer.decode(full_toks, skip_special_tokens=True)
    stop = full_text[10:13]
    assert stop and stop not in full_text[:10]
    text, toks, reason = run_text(engine, PROMPTS[1], SamplingParams(max_tokens=30, temperature=0,
                                                                     ignore_eos=True, stop=[stop, "@@never"]))
    assert reason == "stop"
    assert text == full_text[: full_text.index(stop)]
    assert len(toks) < len(full_toks)


def test_eos_and_stop_token_ids(engine, qwen3_path):
    ids = engine.tokenize(PROMPTS[0])
    ref = hf_greedy(qwen3_path, ids, 10)
    _, toks, reason = run_text(engine, ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                           stop_token_ids=[ref[3]]))
    assert toks == ref[: ref.index(ref[3]) + 1] and reason == "stop"


def test_include_stop_str_in_output_and_skip_special_tokens(engine, qwen3_path):
    """vLLM's text options: the stop string (or stop token's text) kept at the end of the text;
    special tokens' text kept when skip_special_tokens is false."""
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    full_text, full_toks, _ = run_text(engine, PROMPTS[1], SamplingParams(**greedy))
    stop = full_text[10:13]
    text, _, reason = run_text(engine, PROMPTS[1], SamplingParams(**greedy, stop=[stop, "@@never"],
                                                                 include_stop_str_in_output=True))
    assert reason == "stop" and text == full_text[: full_text.index(stop) + len(stop)]
    k = next(i for i, t in enumerate(full_toks) if engine.tokenizer.decode([t]).strip())  # a token with text
    text, toks, reason = run_text(engine, PROMPTS[1], SamplingParams(**greedy, stop_token_ids=[full_toks[k]],
                                                                    include_stop_str_in_output=True))
    assert reason == "stop" and toks == full_toks[: k + 1]
    assert text == engine.tokenizer.decode(toks) and text != engine.tokenizer.decode(toks[:-1])
    special = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")  # forced by a logit bias, never the end
    forced = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={special: 100.0})
    assert run_text(engine, PROMPTS[0], SamplingParams(**forced))[0] == ""
    assert run_text(engine, PROMPTS[0], SamplingParams(**forced, skip_special_tokens=False))[0] == "<|im_end|>" * 3


def test_streamed_text_is_whole_characters(engine):
    for prompt in ["café naïve Straße 東京", "🙂 🚀 ✨", "你好世界"]:
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=5)
        rid = f"u{prompt}"
        engine.add_request(rid, prompt, params)
        pieces, toks = [], []
        while engine.has_unfinished():
            for o in engine.step():
                pieces.append(o.text)
                toks += o.new_token_ids
        # Had a piece split a multi-byte character, it would carry U+FFFD where the whole
        # decode has the character, and the concatenation would differ.
        assert "".join(pieces) == engine.tokenizer.decode(toks, skip_special_tokens=True)
        assert len(pieces) > 5


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"seed": 2**70}, "seed"), ({"stop": [""]}, "stop"),
])
def test_bad_parameters_rejected(engine, kw, param):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("bad", PROMPTS[0], SamplingParams(**kw))
    assert e.value.param == param and e.value.message
    assert "bad" not in engine.seqs


def test_prompt_over_context_and_empty_prompt(engine):
    with pytest.raises(InvalidRequest, match="context"):
        engine.add_request("long", list(range(5)) * 300, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("empty", [], SamplingParams(max_tokens=1))


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="cannot load"):
        LLMEngine(EngineConfig(model="/nonexistent/model/path"))


def test_detokenizer_never_splits_a_character(engine):
    from keyacc_ray.engine.detok import IncrementalDetokenizer

    text = "жЖ€𝄞 done"  # characters the tokenizer never merged: several byte tokens each
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text) // 2
    d = IncrementalDetokenizer(engine.tokenizer, [], stop=[])
    pieces = []
    for t in ids:
        d.step(t)
        pieces.append(d.take(final=False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_cpu_kv_buffer_fits_the_available_memory(qwen3_path, monkeypatch):
    """On CPU the KV block pool is bounded by the RAM available (as on CUDA by the device's
    memory): fewer blocks with a warning (and a context no longer than they hold), or a clear
    load error, not an OOM kill under load."""
    import collections

    import psutil

    probe = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=1, max_model_len=128))
    per_slot = probe.runner.kv_bytes_per_token() * 128
    mem = collections.namedtuple("mem", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(int(3.5 * per_slot / 0.5)))
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8, max_model_len=128, kv_memory_fraction=0.5))
    assert eng.runner.num_blocks == 3.5 * 128 // 16 and eng.stats().num_total_blocks == 28
    assert eng.generate([PROMPTS[0]] * 5, SamplingParams(max_tokens=4, temperature=0))  # 5 requests in 28 blocks
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(int(3 * per_slot / 0.5)))
    assert LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8, max_model_len=128,
                                  kv_memory_fraction=0.5)).max_model_len == 128
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(per_slot // 16))
    with pytest.raises(ModelLoadError, match="no room for one KV block"):
        LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8, max_model_len=128))


def test_lazy_kv_runs_more_at_once_and_preempts_without_changing_tokens(qwen3_path):
    """Lazy KV blocks (the default): sequences take blocks as they grow, so a budget that holds
    4 whole requests runs more of them at once; when blocks run out the newest is preempted and
    later prefills prompt + output again. Every request still gets generate()'s tokens."""
    n, block, max_tokens = 4, 8, 20
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=32, kv_block_size=block, num_kv_blocks=6 * n))
    prompts = [p for p in (eng.tokenize(x)[:28] for x in PROMPTS) if len(p) > 20][:3] * 3
    outs, peak = _run_all(eng, prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert peak > n and eng.scheduler.num_preemptions > 0
    assert eng.blocks.num_free_blocks == 6 * n
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(qwen3_path, p, max_tokens), i


@pytest.mark.parametrize("skip", [0, 16])
def test_a_movable_sequence_leaves_with_its_kv_when_preempted(qwen3_path, skip):
    """Lazy KV, `move_on_preempt`: instead of being recomputed, a preempted sequence is exported
    with its KV (into `preempt_exports`) and continues on another engine with generate()'s tokens.
    With a skip (the head the next engine likely caches), the package leaves that head out."""
    block, max_tokens = 8, 20
    a = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8, kv_block_size=block, num_kv_blocks=12))
    b = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8))
    prompts = [p for p in (a.tokenize(x)[:28] for x in PROMPTS) if len(p) > 20][:3]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if skip:  # b has seen these prompts
        b.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    outs = {}
    for i, p in enumerate(prompts):
        a.add_request(f"r{i}", p, params)
        a.move_on_preempt[f"r{i}"] = skip
    moved = []
    while a.has_unfinished() or b.has_unfinished():
        for eng in (a, b):
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        for pkg in a.preempt_exports:
            assert pkg.meta.num_kv_tokens == len(pkg.token_ids) - 1 > 0  # its KV came along
            assert pkg.meta.kv_start == skip
            moved.append(pkg.request_id)
            b.import_request(pkg)
        a.preempt_exports.clear()
    assert moved and a.scheduler.num_preemptions == len(moved) and not a.move_on_preempt
    assert a.blocks.num_free_blocks == 12
    assert b.stats().kv_import_recomputed_tokens == 0 and (b.stats().kv_import_cached_tokens >= skip * len(moved))
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(qwen3_path, p, max_tokens), i


def test_withdraw_takes_only_a_sequence_that_never_ran(qwen3_path):
    """A request queued behind a full engine can leave (to start over elsewhere) until it runs;
    a running one, or one that came with its KV, cannot. The others' output is untouched."""
    from keyacc_ray.engine.request import SeqStatus

    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=1, dtype="float32"))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = eng.tokenize(PROMPTS[0])
    for rid in ("a", "b", "c"):
        eng.add_request(rid, ids, params)
    eng.step()
    assert eng.seqs["a"].status == SeqStatus.RUNNING and eng.seqs["b"].status == SeqStatus.WAITING
    assert not eng.withdraw("a") and not eng.withdraw("nope")
    assert eng.withdraw("b") and "b" not in eng.seqs
    out: dict[str, list] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert set(out) == {"a", "c"} and out["c"] == hf_greedy(qwen3_path, ids, 4)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_the_engine_measures_how_fast_prompts_go_through(qwen3_path):
    """EngineStats.prefill_tokens_per_s: 0 until a step with PrefillRate.MIN_TOKENS prompt tokens
    or more ran, then prompt tokens a second of such steps (the router's policies read it)."""
    from keyacc_ray.engine.scheduler import PrefillRate

    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2, max_model_len=256))
    eng.generate([[5] * 8], SamplingParams(max_tokens=2, temperature=0))
    assert eng.stats().prefill_tokens_per_s == 0.0  # 8 prompt tokens: not a measure
    eng.generate([[5 + i % 40 for i in range(PrefillRate.MIN_TOKENS * 2)]], SamplingParams(max_tokens=2, temperature=0))
    assert eng.stats().prefill_tokens_per_s > 0
    r = PrefillRate()
    r.observe(100, 0.5)
    r.observe(100, 0.25)
    assert r.tokens_per_s == 0.8 * 200 + 0.2 * 400


@pytest.mark.parametrize("cfg", [{"cpu_kernels": "off"}, {"cpu_kernels": "auto"}])
def test_the_prefill_rate_is_measured_at_start_and_the_engine_is_untouched(qwen3_path, cfg):
    """measure_prefill_rate (a pool replica's start): a rate before the first prompt, from a
    forward through the empty block pool: counters and outputs as without it; once the engine
    has taken a request (its blocks may hold KV), it measures nothing and keeps its blocks."""
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2, max_model_len=256, **cfg))
    assert eng.stats().prefill_tokens_per_s == 0
    ids = [5 + i % 40 for i in range(40)]
    want = hf_greedy(qwen3_path, ids, 6)
    assert eng.measure_prefill_rate() > 0
    assert eng.generate([ids], SamplingParams(max_tokens=6, temperature=0)) == [want]
    assert eng.stats().tokens_generated == 6
    before = eng.stats()
    calls = eng.runner.forward
    eng.runner.forward = None  # (nothing is run now)
    rate = eng.measure_prefill_rate(tokens=64)  # after the prompt was cached: its blocks intact
    eng.runner.forward = calls
    after = eng.stats()
    assert rate == before.prefill_tokens_per_s and after.prefix_cache_queries == before.prefix_cache_queries
    assert after.num_free_blocks == before.num_free_blocks and after.tokens_generated == before.tokens_generated
    assert eng.generate([ids], SamplingParams(max_tokens=6, temperature=0)) == [want]
    assert eng.stats().prefix_cache_hits > before.prefix_cache_hits  # (served from the cached blocks)


def test_an_engine_with_small_prompt_chunks_measures_its_prefill_rate(qwen3_path):
    """max_prefill_tokens below PrefillRate.MIN_TOKENS (a slow CPU pool's chunk): its full chunks
    are the measure. Before, such a pool never had a rate, and the policies took "unknown" for
    "no limit" (the H200-host plan sent it whole 14B prompts that took minutes)."""
    from keyacc_ray.engine.scheduler import PrefillRate

    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2, max_model_len=256, max_prefill_tokens=16))
    assert eng.prefill_rate.min_tokens == 16 < PrefillRate.MIN_TOKENS
    ids = [5 + i % 40 for i in range(40)]
    assert eng.generate([ids], SamplingParams(max_tokens=2, temperature=0)) == [hf_greedy(qwen3_path, ids, 2)]
    assert eng.stats().prefill_tokens_per_s > 0
    assert PrefillRate(max_step_tokens=4096).min_tokens == PrefillRate.MIN_TOKENS

