"""The startup heap frozen out of the cyclic collector: only inside a Serve replica (or forced),
and a full collection afterwards walks only what came later."""
import subprocess
import sys
import textwrap

from keyacc_ray.serve.heap import freeze_startup_heap, in_serve_replica


def test_outside_a_replica_nothing_is_frozen():
    assert not in_serve_replica()
    assert freeze_startup_heap("test") == 0


def test_a_forced_freeze_leaves_a_full_collection_only_what_came_later():
    code = textwrap.dedent("""
        import gc
        import torch  # a heap like a replica's
        from keyacc_ray.serve.heap import freeze_startup_heap
        before = len(gc.get_objects())
        frozen = freeze_startup_heap("test", force=True)
        later = [[i] for i in range(1000)]  # made after: still collected as before
        tracked = len(gc.get_objects())
        print(before, frozen, tracked)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, frozen, tracked = map(int, out.stdout.split())
    assert frozen > 10_000 and frozen >= before // 2
    assert 1000 <= tracked < 2000  # the collector's generations hold only the later objects
