"""Prefix affinity between a pool's replicas, without Ray."""
from keyacc_ray.serve.prefix_affinity import PrefixAffinity, anchors


def test_anchors_are_heads_of_doubling_length_deepest_first():
    a = anchors(list(range(100)), 16)  # 6 full blocks before the last token: heads of 1, 2, 4, 6
    assert len(a) == 4 and len(set(a)) == 4
    assert anchors(list(range(100)) + [7], 16)[1:] == a[1:]  # (a 7th block: heads 1, 2, 4, 6 are the same)
    assert anchors(list(range(40)), 16) == anchors(list(range(40)) + [9] * 7, 16)[-2:]
    assert anchors([1, 2, 3], 16) == [] and anchors(list(range(17)), 16)[0] == anchors(list(range(20)), 16)[0]
    assert anchors([0] + list(range(1, 100)), 16) == a and anchors([5] + list(range(1, 100)), 16)[-1] != a[-1]


def test_a_prompt_goes_where_its_longest_head_went_unless_that_queue_is_long():
    pa = PrefixAffinity(block_size=4, imbalance=2)
    system = list(range(100, 140))
    conv1 = anchors(system + [1] * 20, 4)
    pa.record(conv1, "r1")
    pa.record(anchors(system + [2] * 20, 4), "r2")  # the shared head's anchors now point at r2
    assert pa.preferred(anchors(system + [1] * 20 + [5] * 9, 4), {"r1": 0, "r2": 0}) == "r1"  # its own turn
    assert pa.preferred(anchors(system + [3] * 20, 4), {"r1": 0, "r2": 1}) == "r2"  # the system prompt
    assert pa.preferred(anchors(system + [1] * 24, 4), {"r1": 3, "r2": 0}) is None  # r1 too busy: the usual way
    assert pa.preferred(anchors(system + [1] * 24, 4), {"r1": None, "r2": 5}) == "r1"  # (unknown: taken)
    assert pa.preferred(anchors(list(range(60)), 4), {"r1": 0, "r2": 0}) is None  # never seen
    assert pa.preferred(conv1, {"r2": 0, "r3": 0}) == "r2"  # r1 not a candidate: the next deepest known
    pa.forget("r2")
    assert pa.preferred(conv1, {"r2": 0, "r3": 0}) is None


def test_the_map_is_bounded():
    pa = PrefixAffinity(block_size=4, max_entries=10)
    for i in range(20):
        pa.record(anchors([i] * 40, 4), f"r{i}")
    assert len(pa._where) == 10


def test_pool_prefixes_predict_the_cached_head_per_hop_until_it_is_stale_or_forgotten():
    from keyacc_ray.serve.prefix_affinity import PREFIX_BLOCK, PoolPrefixes

    now = [0.0]
    pp = PoolPrefixes(ttl_s=10.0, clock=lambda: now[0])
    system = list(range(1000, 1000 + 5 * PREFIX_BLOCK))  # 80 tokens
    a = system + [1] * 30
    pp.record(anchors(a, PREFIX_BLOCK), "cpu_decode/0")
    assert pp.cached_tokens(anchors(a, PREFIX_BLOCK), len(a), "cpu_decode/0") == (len(a) - 1) // 16 * 16
    b = system + [2] * 30  # the same 80-token head: its anchor at 4 blocks is shared
    assert pp.cached_tokens(anchors(b, PREFIX_BLOCK), len(b), "cpu_decode/0") == 4 * PREFIX_BLOCK
    assert pp.cached_tokens(anchors(b, PREFIX_BLOCK), len(b), "gpu_decode") == 0  # not sent there
    assert pp.cached_tokens(anchors([7] * 100, PREFIX_BLOCK), 100, "cpu_decode/0") == 0  # never seen
    assert pp.cached_tokens((), 100, "cpu_decode/0") == 0
    now[0] = 11.0  # older than the TTL: not trusted
    assert pp.cached_tokens(anchors(a, PREFIX_BLOCK), len(a), "cpu_decode/0") == 0
    pp.record(anchors(a, PREFIX_BLOCK), "cpu_decode/0")
    pp.record(anchors(a, PREFIX_BLOCK), "gpu_decode")
    pp.forget("cpu_decode/0")  # a replica there failed
    assert pp.cached_tokens(anchors(a, PREFIX_BLOCK), len(a), "cpu_decode/0") == 0
    assert pp.cached_tokens(anchors(a, PREFIX_BLOCK), len(a), "gpu_decode") > 0
    pp.record(anchors(b, PREFIX_BLOCK), "cpu_decode/0")  # ran there after the failure: trusted again
    assert pp.cached_tokens(anchors(a, PREFIX_BLOCK), len(a), "cpu_decode/0") == 4 * PREFIX_BLOCK
    small = PoolPrefixes(max_entries=3)
    small.record(anchors(list(range(200)), PREFIX_BLOCK), "gpu_decode")
    assert len(small._seen) == 3


def test_anchors_stop_at_a_bounded_depth():
    from keyacc_ray.serve.prefix_affinity import MAX_BLOCKS, anchor_depths

    long = list(range(16 * (MAX_BLOCKS + 50)))
    assert anchor_depths(len(long), 16)[0] == MAX_BLOCKS
    assert anchors(long, 16)[0] == anchors(long[:16 * MAX_BLOCKS + 1], 16)[0]
