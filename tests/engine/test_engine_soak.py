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


def test_a_token_other_than_generates_is_a_near_tie_only_within_the_tolerance(qwen3_path):
    import torch

    from tests.helpers import TIE_ULPS, float32_parting, hf_greedy, hf_model

    prompt = [(37 * k + 11) % 400 + 5 for k in range(20)]
    want = hf_greedy(qwen3_path, prompt, 6)
    model, _ = hf_model(qwen3_path)
    with torch.inference_mode():
        second = int(torch.topk(model(torch.tensor([prompt + want[:2]])).logits[0, -1], 2).indices[1])
    # generate()'s second-best token at index 2, then generate()'s own continuation from it
    got = want[:2] + [second] + hf_greedy(qwen3_path, prompt + want[:2] + [second], 3)
    part = float32_parting(qwen3_path, prompt, want, got, 2)
    assert part["rest_follows"] and part["gap"] > 0 and part["gap_ulps"] > TIE_ULPS and not part["near_tie"]
    assert float32_parting(qwen3_path, prompt, want, got, 2, ulps=part["gap_ulps"] + 1)["near_tie"]
    # the same token followed by something else is no tie at any tolerance
    got[4] = (got[4] + 1) % 400
    assert not float32_parting(qwen3_path, prompt, want, got, 2, ulps=10**9)["near_tie"]
