"""scripts/bench_decode_loop.py on a tiny bf16 model: both loops measured, alone and beside the
GIL holder (the figures themselves are the script's to print, not a test's to time)."""
import sys

from tests.conftest import ROOT
from tests.engine.test_bf16_handoff import bf16_path  # noqa: F401 - fixture

sys.path.insert(0, str(ROOT / "scripts"))


def test_both_loops_are_measured(bf16_path):  # noqa: F811
    import bench_decode_loop

    r = bench_decode_loop.measure(bf16_path, batch=2, steps=2, threads=1, hold_us=100, free_us=100)
    assert set(r) == {"python_ms", "native_ms", "python_gil_ms", "native_gil_ms"}
    assert all(v > 0 for v in r.values())
