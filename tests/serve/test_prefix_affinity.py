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
