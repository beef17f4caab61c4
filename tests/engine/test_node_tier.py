"""The node's shared KV tier: blocks in files every process on the machine reads and writes
(without a model: bytes, budget, least recently used eviction, several processes at once), then
engines that share it: a head computed by one is loaded by another, a hand-off leaves it out of
its package, and every output is generate()'s."""
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from keyacc_ray.engine import node_tier
from keyacc_ray.engine.node_tier import NodeTier
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.engine.tiers import DEVICE, LowerTiers, Move
from tests.engine.test_prefix_cache import SYSTEM, _engine, _run
from tests.helpers import hf_greedy

BLOCK = 256


def _row(key: bytes) -> np.ndarray:
    """A block's bytes that say which key they belong to."""
    return np.frombuffer((key * (BLOCK // len(key) + 1))[:BLOCK], dtype=np.uint8).copy()


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_block_is_found_by_key_whole_and_the_least_recently_used_go_first(tmp_path):
    t = NodeTier(str(tmp_path), "fmt", BLOCK, budget_bytes=10 * BLOCK)
    for i in range(10):
        assert t.put(_key(i), _row(_key(i)))
        time.sleep(0.002)  # (distinct modification times)
    assert _key(0) in t and np.array_equal(t.get(_key(0)), _row(_key(0)))  # a hit: now the newest
    assert t.get(_key(99)) is None and _key(99) not in t
    t.put(_key(10), _row(_key(10)))  # past the budget: down to 90% of it, least recently used first
    assert {i for i in range(11) if _key(i) in t} == {0, 5, 6, 7, 8, 9, 10}  # (down to KEEP = 0.75)
    assert len(t) == 7 and t.evictions == 4
    other = NodeTier(str(tmp_path), "fmt", BLOCK, budget_bytes=10 * BLOCK)  # another engine, same format
    assert np.array_equal(other.get(_key(10)), _row(_key(10))) and len(other) == len(t)
    assert NodeTier(str(tmp_path), "other-fmt", BLOCK, 10 * BLOCK).get(_key(10)) is None
    exists = os.path.exists
    os.path.exists = None  # a block this process wrote or read is found without a system call
    try:
        assert _key(10) in t and _key(5) in t
    finally:
        os.path.exists = exists
    other.clear()  # (another process evicts them: a miss when read)
    assert t.get(_key(10)) is None
    stale = tmp_path / "old-fmt"
    stale.mkdir()
    old = time.time() - 2 * node_tier.STALE_FORMAT_S
    os.utime(stale, (old, old))
    NodeTier(str(tmp_path), "fmt", BLOCK, budget_bytes=10 * BLOCK)  # a format nobody wrote into for a day: gone
    assert not stale.exists() and (tmp_path / "other-fmt").exists()


def test_writes_queued_for_the_writer_thread_are_held_until_written_and_dropped_when_it_is_behind(tmp_path, monkeypatch):
    t = NodeTier(str(tmp_path), "fmt", BLOCK, budget_bytes=100 * BLOCK)
    for i in range(20):
        assert t.put_async(_key(i), _row(_key(i)))
    assert all(_key(i) in t for i in range(20))  # (queued or written: not published twice)
    t.flush()
    assert all(np.array_equal(t.get(_key(i)), _row(_key(i))) for i in range(20)) and not t._pending
    monkeypatch.setattr(node_tier, "QUEUE_BYTES", 0)  # a queue of 16 blocks, its writer never started
    slow = NodeTier(str(tmp_path), "slow", BLOCK, budget_bytes=100 * BLOCK)
    slow._writer = object()
    assert sum(slow.put_async(_key(i), _row(_key(i))) for i in range(20)) == 16 and slow.dropped == 4
    assert _key(19) not in slow


def test_a_block_being_written_is_a_miss_and_a_dead_writers_is_written_again(tmp_path):
    t = NodeTier(str(tmp_path), "fmt", BLOCK, budget_bytes=4 * BLOCK)
    path = os.path.join(t.dir, _key(1).hex())
    with open(path, "wb") as f:  # a writer halfway through (or killed there)
        f.write(b"x" * 10)
    assert t.get(_key(1)) is None
    assert not t.put(_key(1), _row(_key(1))) and t.get(_key(1)) is None  # (its writer may still finish it)
    old = time.time() - 3600
    os.utime(path, (old, old))  # a writer that never finished
    assert t.put(_key(1), _row(_key(1))) and np.array_equal(t.get(_key(1)), _row(_key(1)))


def _worker(root: str, seed: int, n: int, bad: "mp.Value") -> None:
    t = NodeTier(root, "fmt", BLOCK, budget_bytes=40 * BLOCK)
    rng = np.random.default_rng(seed)
    for _ in range(n):
        k = _key(int(rng.integers(0, 120)))
        if rng.random() < 0.5:
            t.put(k, _row(k))
        else:
            got = t.get(k)
            if got is not None and not np.array_equal(got, _row(k)):
                with bad.get_lock():
                    bad.value += 1


def test_processes_writing_and_evicting_at_once_never_read_a_wrong_block(tmp_path):
    ctx = mp.get_context("fork")
    bad = ctx.Value("i", 0)
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), s, 600, bad)) for s in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert bad.value == 0
    t = NodeTier(str(tmp_path), "fmt", BLOCK, budget_bytes=40 * BLOCK)  # (its scan keeps the budget)
    assert 0 < len(t) <= 40


def test_the_namespace_changes_with_the_format_and_with_weights_written_again(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a")
    a = node_tier.namespace(str(tmp_path), 2, 4, "bfloat16")
    assert a == node_tier.namespace(str(tmp_path), 2, 4, "bfloat16")
    assert a != node_tier.namespace(str(tmp_path), 2, 4, "float32")
    time.sleep(0.01)
    (tmp_path / "model.safetensors").write_bytes(b"bb")
    assert a != node_tier.namespace(str(tmp_path), 2, 4, "bfloat16")


def test_plan_publishes_what_the_node_lacks_and_loads_what_it_holds(tmp_path):
    node = NodeTier(str(tmp_path), "fmt", BLOCK, budget_bytes=8 * BLOCK)
    node.put(b"k0", _row(b"k0"))
    lt = LowerTiers(0, 0, BLOCK, 4, node=node)
    lt.publish([b"k0", b"k1", b"k1"], [3, 4, 4])  # k0 held already; k1 once
    lt.evicted(b"k2", 5)  # no tier of its own: an evicted block goes to the node
    assert lt.take_moves() == [Move(DEVICE, 4, "node", 0), Move(DEVICE, 5, "node", 1)]
    reads, writes = lt.take_node_side()
    assert writes == [b"k1", b"k2"] and reads == []
    found = lt.find([b"k0", b"k9"])
    assert found == [("node", 0)]
    node.clear()  # another engine's writes push it out after it was found: its bytes are still read
    lt.load(found, [7])
    assert lt.take_moves() == [Move("node", 0, DEVICE, 7)] and lt.hits["node"] == 4
    reads, _ = lt.take_node_side()
    assert np.array_equal(node.read(reads[0]), _row(b"k0"))
    # found for an admission that did not happen (no copy planned): closed at the next look
    node.put(b"k0", _row(b"k0"))
    open_fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        assert lt.find([b"k0"]) == [("node", 0)]
    assert len(lt.node_reads) == 1 and len(os.listdir("/proc/self/fd")) == open_fds + 1
    lt.close_node_reads()
    assert len(os.listdir("/proc/self/fd")) == open_fds


# ---- engines sharing it -------------------------------------------------------------------------
def _sharing(path, root, **cfg):
    # (kv_tier_load "always": the tiny model computes a block about as fast as a copy's fixed cost)
    return _engine(path, kv_node_tier_gb=0.001, kv_node_tier_dir=str(root), kv_tier_load="always", **cfg)


def test_a_head_one_engine_computed_is_loaded_by_another(qwen3_path, tmp_path):
    a, b = _sharing(qwen3_path, tmp_path), _sharing(qwen3_path, tmp_path)
    first = SYSTEM + [7, 8, 9]  # 26 tokens
    outs, _ = _run(a, [first])
    a.tiers.node.flush()  # (the tier's writer thread, behind the engine)
    assert a.stats().kv_tiers["tiers"]["node"]["stored_blocks"] == 8  # 33 computed tokens: 8 full blocks
    turn = first + outs[0] + [42, 43]
    b.calls.clear()
    outs2, cached = _run(b, [turn])
    assert cached == [32] and b.calls[0] == [(4, 32)]  # only what the node did not hold
    assert outs2[0] == hf_greedy(qwen3_path, turn, 8)
    assert b.stats().kv_tiers["tiers"]["node"]["loaded_blocks"] == 8
    # another format (float32 vs bfloat16 KV) shares nothing
    c = _sharing(qwen3_path, tmp_path, dtype="bfloat16")
    _, cached = _run(c, [turn])
    assert cached == [0]


def test_a_hand_off_leaves_the_blocks_the_node_holds_out_of_its_package(qwen3_path, tmp_path):
    a, b = _sharing(qwen3_path, tmp_path), _sharing(qwen3_path, tmp_path)
    prompt = SYSTEM + [9, 9, 9]  # 26 tokens: 6 full blocks
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    a.add_request("x", prompt, p)
    got = []
    while len(got) < 3:
        got += [t for o in a.step() for t in o.new_token_ids]
    pkg = a.export_request("x", skip_tokens=10**6)  # the next engine shares this node's tier
    assert pkg.meta.kv_start == 28 and pkg.meta.num_kv_tokens == 28  # 7 full blocks, all in the node's tier
    b.import_request(pkg)
    while b.has_unfinished():
        got += [t for o in b.step() for t in o.new_token_ids]
    assert got == hf_greedy(qwen3_path, prompt, 10)
    assert b.scheduler.import_cached_tokens == 28 and b.scheduler.import_recomputed_tokens == 0
    assert b.stats().kv_tiers["tiers"]["node"]["loaded_blocks"] == 7  # loaded, nothing recomputed
    assert a.blocks.num_free_blocks == a.blocks.num_blocks and b.blocks.num_free_blocks == b.blocks.num_blocks


def test_an_importer_that_finds_nothing_in_the_node_computes_the_left_out_head(qwen3_path, tmp_path):
    a = _sharing(qwen3_path, tmp_path / "one")
    b = _sharing(qwen3_path, tmp_path / "other")  # (another machine's tier)
    prompt = SYSTEM + [9, 9, 9]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a.add_request("x", prompt, p)
    got = [t for o in a.step() for t in o.new_token_ids]
    b.import_request(a.export_request("x", skip_tokens=10**6))
    while b.has_unfinished():
        got += [t for o in b.step() for t in o.new_token_ids]
    assert got == hf_greedy(qwen3_path, prompt, 8) and b.scheduler.import_recomputed_tokens > 0
