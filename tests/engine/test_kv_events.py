"""What an engine tells the router of where it holds prompts' heads (engine/kv_events.py): for the
blocks at the router's anchor depths, the tier each is in now (device pool, host, disk) or gone,
as changes. Without a model (the block pool and the tiers' plans), then a real engine."""
import random

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.blocks import BlockManager, chain_hashes
from keyacc_ray.engine.kv_events import GONE, attach, is_anchor_depth
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.engine.tiers import LowerTiers
from keyacc_ray.serve.prefix_affinity import PREFIX_BLOCK, anchor_depths

B = 16


def _mirror(told: dict, events) -> None:
    for key, tier in events:
        assert tier != told.get(key, GONE), "an event that changes nothing"
        if tier == GONE:
            told.pop(key)
        else:
            told[key] = tier


def test_anchor_depths_are_those_the_router_keys_prompts_by():
    for n in (1, 2, 3, 5, 17, 64, 200, 1025, 3000):
        router = set(anchor_depths(n * PREFIX_BLOCK + 1, PREFIX_BLOCK)) - {min(n, 1024)}
        assert router == {d for d in range(1, min(n, 1024)) if is_anchor_depth(d)}, n


def test_a_pool_with_tiers_tells_where_each_anchor_block_is_as_it_moves():
    """Random sequences through a small pool whose evictions go to host, then disk, then nowhere:
    after every drain what was told is where each anchor block is; blocks at other depths are
    never told; a reset tells every one gone."""
    rng = random.Random(3)
    bm = BlockManager(num_blocks=24, block_size=B, prefix_caching=True)
    tiers = LowerTiers(host_slots=6, disk_slots=5, block_bytes=1024, block_size=B)
    bm.on_evict = tiers.evicted
    events = attach(bm, tiers)
    told: dict[bytes, str] = {}
    seen_tiers: set[str] = set()
    anchor_keys: dict[bytes, int] = {}  # every key computed at an anchor depth -> its depth
    other_keys: set[bytes] = set()
    heads = [[rng.randrange(1000) for _ in range(16 * B)] for _ in range(3)]
    for step in range(60):
        head = rng.choice(heads)
        toks = head[:rng.randrange(1, 16) * B] + [rng.randrange(1000) for _ in range(rng.randrange(0, 5 * B))]
        keys = chain_hashes([], toks, B)
        sid = f"s{step}"
        if not bm.allocate(sid, len(toks) + 1):
            continue
        bm.register(sid, keys, len(keys))
        for d, k in enumerate(keys, 1):
            (anchor_keys.__setitem__(k, d) if is_anchor_depth(d) else other_keys.add(k))
        bm.free(sid)
        tiers.take_moves()
        if rng.random() < 0.5:
            _mirror(told, events.drain())
            truth = {k: events.where(k) for k in anchor_keys}
            assert told == {k: t for k, t in truth.items() if t != GONE}
            seen_tiers |= set(told.values())
            assert not set(told) & (other_keys - set(anchor_keys))
    _mirror(told, events.drain())
    assert seen_tiers == {"device", "host", "disk"}
    assert any(events.where(k) == GONE for k in anchor_keys)  # some fell off the bottom
    bm.reset_prefix_cache()
    tiers.reset()
    _mirror(told, events.drain())
    assert told == {}


def test_a_resync_tells_everything_held_again():
    bm = BlockManager(num_blocks=8, block_size=B, prefix_caching=True)
    events = attach(bm)
    keys = chain_hashes([], list(range(4 * B)), B)
    assert bm.allocate("a", 4 * B + 1)
    bm.register("a", keys, 4)
    first = events.drain()
    assert sorted(first) == sorted((keys[d - 1], "device") for d in (1, 2, 4))
    assert events.drain() == []
    events.resync()
    assert sorted(events.drain()) == sorted(first)


def test_an_engine_tells_where_its_prompts_heads_are(qwen3_path):
    """The real engine (16-token blocks, a host tier under a small pool): what a drain tells is
    where each anchor block of every prompt it ran is, device or host, and gone once dropped."""
    eng = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", max_num_seqs=2, num_kv_blocks=24,
                                 kv_host_tier_gb=10 * 8192 / 2**30))  # 10 host blocks of the tiny model's
    assert eng.kv_events is not None and eng.tiers.tiers[0].num_slots == 10
    told: dict[bytes, str] = {}
    prompts = [[(31 * i + 7 * k) % 400 + 5 for k in range(9 * B + 3)] for i in range(4)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        _mirror(told, eng.kv_events.drain())
    anchors = {k for p in prompts for d, k in enumerate(chain_hashes([], p, B), 1) if is_anchor_depth(d)}
    assert set(told) <= anchors and told == {k: t for k in anchors if (t := eng.kv_events.where(k)) != GONE}
    assert set(told.values()) == {"device", "host"} and any(eng.kv_events.where(k) == GONE for k in anchors)
    assert all(eng.blocks._block_of.get(k) is not None for k, t in told.items() if t == "device")
    eng.reset_prefix_cache()
    _mirror(told, eng.kv_events.drain())
    assert told == {}


def test_no_events_where_the_router_cannot_use_them(qwen3_path):
    assert LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", kv_block_size=8, num_kv_blocks=32)).kv_events is None
    assert LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", num_kv_blocks=32,
                                  enable_prefix_caching=False)).kv_events is None
