"""The stack benchmark's stand-in engine (no model): admits up to max_num_seqs, paces one token per
sequence per tick, finishes each at its max_tokens, refuses hand-offs, and reports like an engine."""
import time

import pytest

from keyacc_ray.bench.token_source import TOKEN_ID, TokenSourceEngine
from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.errors import InvalidRequest


def test_token_source_paces_and_finishes():
    eng = TokenSourceEngine(EngineConfig(model="none", max_num_seqs=2), tokens_per_s=200.0)
    for i, n in enumerate((3, 5, 2)):
        eng.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=n))
    got, t0, steps = {}, time.monotonic(), 0
    while eng.has_unfinished():
        outs = eng.step()
        steps += 1
        assert len(outs) <= 2  # max_num_seqs
        for o in outs:
            assert o.new_token_ids == [TOKEN_ID] and o.num_prompt_tokens == 3
            got.setdefault(o.request_id, []).append(o)
    assert {r: len(v) for r, v in got.items()} == {"r0": 3, "r1": 5, "r2": 2}
    assert all(v[-1].finished and v[-1].finish_reason == "length" for v in got.values())
    assert time.monotonic() - t0 >= (steps - 1) / 200.0 * 0.9  # paced, not spinning
    assert eng.stats().tokens_generated == 10 and "TOKEN SOURCE" in eng.runner.device_label()
    with pytest.raises(InvalidRequest):
        eng.export_request("r0")
