"""scripts/stress_engine.py, short: two engines shaped like the soak's pools (small lazy block
pools, host and disk tiers, prefix caching over shared prompt heads), sequences handed between
them with and without their cached head, preempted, some past max_num_seqs as streams under way,
some aborted. Every completion is transformers' generate()'s (or a float32 near-tie), and idle,
every block is free."""
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.parametrize("under_way", [0, 8])
def test_hand_offs_preemptions_and_tier_loads_keep_every_completion_right(qwen3_path, under_way):
    import stress_engine

    stats, wrong = stress_engine.run(qwen3_path, requests=90, seed=5, under_way=under_way, b_blocks=80, b_seqs=4,
                                     a_growth_reserve=False)
    assert not wrong, wrong
    assert stats["blocks_free"], stats
    # what the run must have gone through for the check to mean anything
    assert stats["checked"] >= 60 and stats["near_tie"] <= 2, stats
    assert stats["preemptions"]["b"] > 0 and stats["handoffs"] > 10 and stats["preempt_moves"] > 0, stats
    assert stats["b_tiers"]["host"]["loaded_blocks"] > 0 and stats["b_tiers"]["disk"]["stored_blocks"] > 0, stats
    if under_way:
        assert stats["most_running"]["b"] > 4, stats  # streams under way past max_num_seqs
    else:
        assert stats["most_running"]["b"] == 4, stats
