"""Automatic prefix caching: keys, reference counts, eviction and the scheduler's sharing without a
model; then the engine, whose hits give the tokens a miss gives (transformers' generate())."""
import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.blocks import BlockManager, chain_hashes
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams, Sequence
from keyacc_ray.engine.scheduler import Scheduler
from tests.helpers import hf_greedy


def test_keys_name_the_whole_prefix():
    a = chain_hashes([], [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # full blocks only
    assert chain_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    b = chain_hashes([], [0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]  # the same second block after another first one
    assert chain_hashes([], [5, 6, 7, 8], 4)[0] != a[1]
    grown = chain_hashes(list(a), list(range(1, 13)), 4)  # extends, recomputing nothing
    assert grown[:2] == a and len(grown) == 3


def _registered(bm, sid, tokens):
    hashes = chain_hashes([], tokens, bm.block_size)
    bm.allocate(sid, len(tokens))
    bm.register(sid, hashes, len(tokens) // bm.block_size)
    return hashes


def test_shared_blocks_are_counted_and_kept_until_their_memory_is_needed():
    bm = BlockManager(num_blocks=6, block_size=4, prefix_caching=True)
    toks = list(range(100, 112))  # 3 full blocks
    keys = _registered(bm, "a", toks)
    a_blocks = bm.block_table("a")
    assert bm.cached_prefix(keys, 3) == 3 and bm.num_cached_blocks == 3
    assert bm.allocate("b", 14, keys[:2])  # shares two, takes two more
    assert bm.block_table("b")[:2] == a_blocks[:2] and not set(bm.block_table("b")[2:]) & set(a_blocks)
    assert bm.num_free_blocks == 1
    bm.free("a")  # b still holds the first two; a's third keeps its KV and key, free to take
    assert bm.num_free_blocks == 2 and bm.cached_prefix(keys, 3) == 3
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    # all six taken: the unkeyed free ones first, then cached ones, the tail of a prefix first
    assert bm.allocate("c", 4 * 4)
    assert bm.evictions == 1 and bm.cached_prefix(keys, 3) == 2
    assert bm.allocate("d", 8) and bm.evictions == 3 and bm.cached_prefix(keys, 3) == 0
    assert not bm.allocate("e", 1)
    bm.free("c"), bm.free("d")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 0


def test_taking_cached_blocks_counts_against_the_free_ones():
    bm = BlockManager(num_blocks=4, block_size=4, prefix_caching=True)
    keys = _registered(bm, "a", list(range(8)))
    bm.free("a")  # 2 cached free + 2 free
    assert not bm.allocate("b", 4 * 5, keys)  # 2 shared + 3 new > 4 blocks
    assert bm.num_free_blocks == 4 and bm.cached_prefix(keys, 2) == 2  # nothing changed
    assert bm.allocate("b", 4 * 4, keys) and bm.num_free_blocks == 0


def test_same_content_computed_twice_keeps_one_key():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    toks = list(range(8))
    keys = _registered(bm, "a", toks)
    _registered(bm, "b", toks)  # computed beside a, not shared: its blocks stay unkeyed
    assert bm.num_cached_blocks == 2
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    bm.free("a")
    assert bm.cached_prefix(keys, 2) == 2 and bm.reset_prefix_cache() == 2 and bm.cached_prefix(keys, 2) == 0


def _seq(rid, tokens, max_tokens=4):
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens))


def _computed(sched, out):
    """What the engine does after a forward: tokens cached, full blocks keyed, a token sampled."""
    bs = sched.blocks.block_size
    for s, n in [(s, 1) for s in out.decode] + out.prefill:
        s.num_cached += n
        sched.blocks.register(s.request_id, chain_hashes(s.block_hashes, s.token_ids, bs), s.num_cached // bs)
        if s.num_cached == s.num_tokens:
            s.token_ids.append(7)


def test_scheduler_prefills_only_what_is_not_cached():
    bm = BlockManager(num_blocks=32, block_size=4, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_waiting=8, max_prefill_tokens=64, lazy=True)
    prompt = list(range(50, 60))  # 2 full blocks + 2 tokens
    a = _seq("a", prompt)
    sched.add(a)
    _computed(sched, sched.schedule())
    b = _seq("b", prompt + [1, 2, 3])
    sched.add(b)
    out = sched.schedule()
    assert out.prefill == [(b, 5)] and b.num_cached == 8 and b.num_cached_prompt_tokens == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert (bm.queries, bm.hits) == (10 + 13, 8)
    # a prompt that is all cached still computes its last token (its logits give the next one)
    _computed(sched, out)
    c = _seq("c", prompt[:8])
    sched.add(c)
    out = sched.schedule()
    assert (c, 4) in out.prefill and c.num_cached == 4


def test_a_common_prefix_in_one_step_is_prefilled_once():
    """Choices of one prompt (n > 1) arrive together: the first prefills, the others wait a
    step and share its blocks."""
    bm = BlockManager(num_blocks=32, block_size=4, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_waiting=8, max_prefill_tokens=64, lazy=True)
    prompt = list(range(20, 37))  # 4 full blocks + 1
    seqs = [_seq(f"c{i}", prompt) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.prefill == [(seqs[0], 17)]
    _computed(sched, out)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.prefill] == [("c1", 1), ("c2", 1)]
    assert bm.block_table("c1")[:4] == bm.block_table("c0")[:4] == bm.block_table("c2")[:4]
    # a different prompt behind them is not held back by what they share
    other = _seq("o", list(range(200, 210)))
    sched.add(other)
    assert sched.schedule().prefill[-1] == (other, 10)


def test_off_means_no_sharing():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_waiting=8, max_prefill_tokens=64, lazy=True)
    a, b = _seq("a", range(12)), _seq("b", range(12))
    sched.add(a), sched.add(b)
    out = sched.schedule()
    assert out.prefill == [(a, 12), (b, 12)] and bm.num_cached_blocks == 0


# ---- the engine --------------------------------------------------------------------------------
def _engine(path, **cfg):
    cfg = {"max_num_seqs": 8, "dtype": "float32", "kv_block_size": 4, **cfg}
    eng = LLMEngine(EngineConfig(model=path, **cfg))
    eng.calls = []
    real = eng.runner.forward
    eng.runner.forward = lambda items, **k: eng.calls.append([(len(i.tokens), i.start) for i in items]) or real(items, **k)
    return eng


def _run(eng, prompts, n=8, **params):
    """Each prompt to the end (all queued at once): outputs and each request's cached tokens."""
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **params)
    ids = [f"r{len(eng.calls)}-{i}" for i in range(len(prompts))]
    outs, cached = {i: [] for i in ids}, {}
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, prompt, p)
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    return [outs[i] for i in ids], [cached[i] for i in ids]


SYSTEM = [(37 * k + 11) % 400 + 5 for k in range(23)]


@pytest.mark.parametrize("arch_fixture", ["qwen3_path", "llama_path", "qwen2_path", "mistral_path"])
@pytest.mark.parametrize("cfg", [{"cpu_kernels": "off"}, {"cpu_kernels": "auto"},
                                 {"cpu_kernels": "off", "paged_attention": "off"}])  # (the model's own attention)
def test_a_hit_gives_the_tokens_of_a_miss(arch_fixture, cfg, request):
    path = request.getfixturevalue(arch_fixture)
    eng = _engine(path, **cfg)
    first = SYSTEM + [7, 8, 9]
    outs, cached = _run(eng, [first])
    assert cached == [0] and outs[0] == hf_greedy(path, first, 8)
    # another turn: the same head and more; and the first prompt again
    turns = [SYSTEM + [7, 8, 9] + outs[0] + [42, 43], first]
    eng.calls.clear()
    outs2, cached2 = _run(eng, turns)
    # the first run keyed 8 full blocks (its 33 computed tokens: prompt and output); the next
    # turn (36 tokens) shares all 8; the first prompt again (26) shares 6 and computes its last 2
    assert cached2 == [32, 24]
    assert sorted(eng.calls[0]) == [(2, 24), (4, 32)]  # only what was not cached
    for p, out in zip(turns, outs2):
        assert out == hf_greedy(path, p, 8)


def test_choices_of_one_prompt_share_one_prefill(qwen3_path):
    eng = _engine(qwen3_path)
    prompt = SYSTEM + [1, 2, 3]
    outs, cached = _run(eng, [prompt] * 3)
    assert eng.calls[0] == [(26, 0)]  # the first choice alone
    assert eng.calls[1] == [(1, 26), (2, 24), (2, 24)]  # its first decode beside the others' last tokens
    assert cached == [0, 24, 24]
    assert outs == [hf_greedy(qwen3_path, prompt, 8)] * 3


def test_hits_under_preemption_and_eviction_keep_tokens_and_leak_no_block(qwen3_path):
    """A budget far below the working set: sequences preempted (recomputed from what is still
    cached), cached blocks evicted; every output is generate()'s, and idle, every block is free."""
    eng = _engine(qwen3_path, num_kv_blocks=24, max_num_seqs=6)
    heads = [SYSTEM, [(5 * k + 3) % 300 + 2 for k in range(19)]]
    prompts = [heads[i % 2] + [i, i + 1] for i in range(8)]
    outs, cached = _run(eng, prompts, n=14)
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.evictions > 0 and any(cached)
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(qwen3_path, p, 14)
    assert eng.blocks.num_free_blocks == 24 and not any(eng.blocks._ref) and not eng.blocks.tables
    s = eng.stats()
    assert s.prefix_cache_hits > 0 and s.prefix_cache_queries >= sum(map(len, prompts))
    assert eng.reset_prefix_cache() > 0 and eng.blocks.num_cached_blocks == 0


def test_scored_prompts_are_computed_not_shared(qwen3_path):
    eng = _engine(qwen3_path)
    prompt = SYSTEM + [4, 5]
    _run(eng, [prompt])
    scored = []
    eng.add_request("s", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    while eng.has_unfinished():
        scored += [o for o in eng.step()]
    assert scored[0].num_cached_tokens == 0 and len(scored[0].prompt_logprobs) == len(prompt)
    ref = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", enable_prefix_caching=False))
    ref.add_request("s", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    want = [o for o in ref.step()][0].prompt_logprobs
    assert [e and round(e[0], 4) for e in scored[0].prompt_logprobs] == [e and round(e[0], 4) for e in want]


def test_a_handed_off_sequence_keeps_its_tokens_and_seeds_the_receivers_cache(qwen3_path):
    a, b = _engine(qwen3_path), _engine(qwen3_path)
    prompt = SYSTEM + [9, 9, 9]
    _run(a, [prompt], n=2)  # cached on a
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    a.add_request("x", prompt, p)
    got = []
    while len(got) < 3:
        got += [t for o in a.step() for t in o.new_token_ids]
    pkg = a.export_request("x")  # its KV read through a table whose head is shared
    b.import_request(pkg)
    while b.has_unfinished():
        got += [t for o in b.step() for t in o.new_token_ids]
    assert got == hf_greedy(qwen3_path, prompt, 10)
    outs, cached = _run(b, [prompt], n=4)  # b keyed the imported blocks
    assert cached == [24] and outs[0] == hf_greedy(qwen3_path, prompt, 4)
    assert a.blocks.num_free_blocks == a.blocks.num_blocks


# ---- lower tiers ---------------------------------------------------------------------------------
def test_tier_index_pushes_out_the_least_recently_used_unpinned_key():
    from keyacc_ray.engine.tiers import TierIndex

    t = TierIndex("host", 2)
    assert t.place(b"a")[1:] == (None, -1) and t.place(b"b")[1:] == (None, -1)
    t.touch(b"a")  # b is now the least recently used
    slot_b = t.slot_of[b"b"]
    assert t.place(b"c") == (slot_b, b"b", slot_b) and b"b" not in t
    t.pinned.update({b"a", b"c"})
    assert t.place(b"d") is None  # every slot pinned: nothing pushed out
    assert t.evictions == 1


def test_plan_copies_a_pushed_out_block_down_before_its_slot_is_written():
    from keyacc_ray.engine.tiers import DEVICE, LowerTiers, Move

    lt = LowerTiers(host_slots=1, disk_slots=1, block_bytes=1000, block_size=4)
    lt.evicted(b"k1", 7)
    lt.evicted(b"k2", 3)  # k1 goes down to disk first, then k2 takes its host slot
    lt.evicted(b"k3", 5)  # k2 down (k1 dropped from disk), k3 in
    assert lt.take_moves() == [Move(DEVICE, 7, "host", 0), Move("host", 0, "disk", 0), Move(DEVICE, 3, "host", 0),
                               Move("host", 0, "disk", 0), Move(DEVICE, 5, "host", 0)]
    assert b"k1" not in lt.tier("disk") and b"k2" in lt.tier("disk") and b"k3" in lt.tier("host")
    found = lt.find([b"k3", b"k2", b"k9"])
    assert found == [("host", b"k3"), ("disk", b"k2")]
    lt.evicted(b"k4", 1)  # both slots pinned by the planned loads: k4 is dropped, not stored
    lt.load(found, [11, 12])
    assert lt.take_moves() == [Move("host", 0, DEVICE, 11), Move("disk", 0, DEVICE, 12)]
    assert lt.hits == {"host": 4, "disk": 4} and b"k4" not in lt.tier("host")


def test_batched_copies_give_what_copies_one_by_one_give():
    """tiers.batches groups a step's copies by kind as far as their order allows: over random
    plans on a few slots (chains through one slot included), running its batches (each reads all
    its sources, then writes all its destinations) leaves every slot as the plan run one copy at
    a time does; and an eviction chain over distinct slots takes two batches, not one a copy."""
    import random

    from keyacc_ray.engine.tiers import DEVICE, Move, batches

    kinds = [DEVICE, "host", "disk"]
    rng = random.Random(7)
    for _ in range(300):
        moves = []
        for _ in range(rng.randrange(1, 14)):
            a, b = rng.sample(kinds, 2)
            moves.append(Move(a, rng.randrange(3), b, rng.randrange(3)))
        one = {(k, i): (k, i) for k in kinds for i in range(3)}  # each slot starts holding its own name
        for m in moves:
            one[(m.dst, m.dst_index)] = one[(m.src, m.src_index)]
        grouped = {(k, i): (k, i) for k in kinds for i in range(3)}
        for batch in batches(moves):
            assert len({(m.src, m.dst) for m in batch}) == 1
            got = [grouped[(m.src, m.src_index)] for m in batch]
            for m, v in zip(batch, got):
                grouped[(m.dst, m.dst_index)] = v
        assert grouped == one, moves
        assert sorted(map(id, sum(batches(moves), []))) == sorted(map(id, moves))
    chain = [m for k in range(8) for m in (Move("host", k, "disk", k), Move(DEVICE, 10 + k, "host", k))]
    assert [len(b) for b in batches(chain)] == [8, 8]


def test_a_tier_slower_than_recomputing_is_not_loaded():
    from keyacc_ray.engine.tiers import LowerTiers

    lt = LowerTiers(host_slots=4, disk_slots=4, block_bytes=1 << 20, block_size=16)
    lt.evicted(b"a", 0), lt.evicted(b"b", 1)
    lt.evicted(b"c", 2), lt.evicted(b"d", 3), lt.evicted(b"e", 4)  # a goes to disk
    lt.take_moves()
    lt.prefill.observe(16_000, 1.0)  # a block computes in 1 ms
    lt.measured("host", 10 << 30, 1.0)  # loads in 0.1 ms from host
    lt.measured("disk", 100 << 20, 1.0)  # 10 ms from disk
    assert lt.find([b"b", b"c"]) == [("host", b"b"), ("host", b"c")]
    assert lt.find([b"a", b"b"]) == [] and lt.recomputed == 2
    lt.take_moves()
    # measured that slow long ago: loaded once more (all it holds of the head), to measure again;
    # a fast reading then stands for itself (not averaged into the slow one)
    from keyacc_ray.engine import tiers as tiers_mod

    lt.measured_at["disk"] -= tiers_mod.REPROBE_S
    assert lt.find([b"a", b"b"]) == [("disk", b"a"), ("host", b"b")] and lt.reprobes["disk"] == 1
    lt.take_moves()
    assert lt.find([b"a"]) == [] and lt.reprobes["disk"] == 1  # (one probe per REPROBE_S)
    lt.take_moves()
    lt.measured("disk", 10 << 30, 1.0)  # the probe's copy: fast now
    assert lt.bandwidth["disk"] == 10 << 30 and lt.find([b"a"]) == [("disk", b"a")]
    lt.take_moves()
    lt.measured("disk", 100 << 20, 1.0)  # slow again: averaged in as usual
    assert lt.bandwidth["disk"] > 1 << 30
    lt.always_load = True  # (EngineConfig.kv_tier_load "always")
    lt.bandwidth["disk"] = 1.0
    assert lt.find([b"a", b"b"]) == [("disk", b"a"), ("host", b"b")] and lt.reprobes["disk"] == 1


@pytest.mark.parametrize("tiers", [{"kv_host_tier_gb": 0.001}, {"kv_disk_tier_gb": 0.001},
                                   {"kv_host_tier_gb": 0.00002, "kv_disk_tier_gb": 0.001}])  # 10 host blocks
def test_blocks_loaded_from_lower_tiers_give_the_tokens_of_a_miss(qwen3_path, tmp_path, tiers):
    """A device pool far below the working set: cached blocks pushed out to host memory and disk
    come back for later prompts; every output is generate()'s, and no block leaks."""
    # (the tiny model computes a block about as fast as a copy's fixed cost: the cost model may
    # rightly recompute; here every load is taken, to check what it loads)
    eng = _engine(qwen3_path, num_kv_blocks=16, max_num_seqs=2, kv_disk_tier_dir=str(tmp_path), kv_tier_load="always",
                  **tiers)
    heads = [[(53 * i + 7 * k) % 400 + 5 for k in range(32)] for i in range(4)]  # 8 blocks each
    outs, _ = _run(eng, heads, n=4)  # each run leaves its blocks cached; the device holds two at most
    again, cached = _run(eng, [h + [99] for h in heads], n=6)
    t = eng.stats().kv_tiers["tiers"]
    assert all(x["loaded_blocks"] > 0 for x in t.values()) and all(c >= 24 for c in cached), (t, cached)
    for h, out in zip(heads, again):
        assert out == hf_greedy(qwen3_path, h + [99], 6)
    assert eng.blocks.num_free_blocks == 16 and not any(eng.blocks._ref)
    assert not list(tmp_path.iterdir())  # the disk tier's file has no name (unlinked once mapped)
