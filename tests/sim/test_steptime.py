"""The simulator's step-time model (keyacc_ray/sim/steptime.py): the knots form a profile is fitted
in, the fit recovering a known device from its steps, and the prompt-attention pairs the simulated
engine counts for a chunked prompt."""
import json

import pytest

from keyacc_ray.sim.engine import SimEngine
from keyacc_ray.sim.steptime import StepTime, fit, knot_weights

# a device whose step is not a line in its tokens (the shape measured on this box's CPU)
KNOTS = [[1, 0.010], [4, 0.016], [8, 0.021], [16, 0.023], [32, 0.027]]
TRUE = StepTime("true", 0.0, 0.00038, 0.00006, 1.6e-6, token_knots=KNOTS, b_prefill_attn=3e-7)


def test_knot_weights_interpolate_between_knots_and_go_on_past_the_last():
    assert knot_weights([1, 4, 8], 4) == ([0.0, 1.0, 0.0], 0.0)
    w, past = knot_weights([1, 4, 8], 6)
    assert w == pytest.approx([0.0, 0.5, 0.5]) and past == 0.0
    assert knot_weights([1, 4, 8], 0.5) == ([0.5, 0.0, 0.0], 0.0)  # from (0, 0)
    assert knot_weights([1, 4, 8], 20) == ([0.0, 0.0, 1.0], 12)


def test_a_step_counts_prompt_tokens_and_decode_rows_through_the_same_knots():
    # 8 decode rows alone: L(8) + their own cost + their KV
    assert TRUE.seconds(0, 8, 1000) == pytest.approx(0.021 + 8 * 0.00006 + 1000 * 1.6e-6)
    # a 64-token prompt joining them: L(72) = L(32) + 40 tokens past the knots; its 64 x 65 / 2 pairs
    assert TRUE.seconds(64, 8, 1000) == pytest.approx(0.027 + 40 * 0.00038 + 8 * 0.00006 + 1000 * 1.6e-6
                                                      + 2080 * 3e-7)
    # the same chunk over 100 cached tokens attends 64 x 100 more pairs
    assert TRUE.seconds(64, 0, 0, 64 * 100 + 2080) == pytest.approx(TRUE.seconds(64, 0, 0) + 6400 * 3e-7)
    # joining the rows costs the prompt far less than its own step: they share the fixed cost
    assert TRUE.seconds(64, 8, 0) < TRUE.seconds(64, 0, 0) + TRUE.seconds(0, 8, 0) - 0.008
    assert TRUE.scaled(2.0).seconds(64, 8, 1000) == pytest.approx(2 * TRUE.seconds(64, 8, 1000))


def test_the_fit_recovers_a_known_device_from_its_steps(tmp_path):
    grid = [(p, 0, 0) for p in (32, 128, 512)]
    grid += [(0, r, r * ctx) for r in (1, 2, 4, 8, 16, 32) for ctx in (66, 386)]
    grid += [(64, 8, 584), (64, 31, 2263), (128, 16, 2192), (256, 31, 4247)]
    points = [{"prefill_tokens": p, "decode_rows": r, "kv_tokens": kv, "seconds": TRUE.seconds(p, r, kv)}
              for p, r, kv in grid]
    got = fit(points, "fitted", "test")
    assert [k for k, _ in got.token_knots] == [1, 2, 4, 8, 16, 32]
    for k, s in got.token_knots:
        assert s == pytest.approx(TRUE.tokens_s(k), rel=1e-6)
    assert got.b_prefill == pytest.approx(TRUE.b_prefill, rel=1e-6)
    assert got.b_decode == pytest.approx(TRUE.b_decode, rel=1e-6)
    assert got.b_kv == pytest.approx(TRUE.b_kv, rel=1e-6)
    assert got.b_prefill_attn == pytest.approx(TRUE.b_prefill_attn, rel=1e-6)
    assert max(abs(r) for r in got.residuals.values()) < 1e-6
    # a steady 5% too slow at 8 rows is left as a residual there, not spread over the rest
    slow = [dict(p, seconds=p["seconds"] * (1.05 if p["decode_rows"] == 8 and not p["prefill_tokens"] else 1))
            for p in points]
    worse = fit(slow)
    assert worse.residuals["p0_r1_kv66"] == pytest.approx(0, abs=0.01)
    # a profile file round-trips (what simulate.py --profile loads)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(got.to_dict()))
    back = StepTime.load(str(f))
    assert back.seconds(100, 20, 3000) == pytest.approx(got.seconds(100, 20, 3000))


def test_the_fit_needs_a_decode_step_measured_alone():
    with pytest.raises(ValueError):
        fit([{"prefill_tokens": 32, "decode_rows": 0, "kv_tokens": 0, "seconds": 0.02}])


def test_the_simulated_engine_counts_each_chunks_attention_pairs():
    """A 100-token prompt fed in chunks of 40, 40 and 20: the second chunk attends the 40 cached
    tokens and itself, and so on (n x cached + n(n + 1) / 2), as the real attention does."""
    st = StepTime("attn-only", 0.0, 0.0, 0.0, 0.0, b_prefill_attn=1.0)
    e = SimEngine("e", "GpuDecode", "gpu", st, max_num_seqs=4, num_blocks=64, max_prefill_tokens=40)
    assert e.add("r", 100, 0, 4, with_kv=False)
    got = [e.step().seconds for _ in range(3)]
    assert got == [40 * 41 / 2, 40 * 40 + 40 * 41 / 2, 20 * 80 + 20 * 21 / 2]
