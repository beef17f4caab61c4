"""The cross-route fuzzer's own logic: its cases and its comparison (the e2e run is in
tests/e2e/test_openai_api.py)."""
import random

from keyacc_ray.bench import route_fuzz


def answer(ids, lps=None, usage=(3, 5)):
    return ([("text", ids, "length", ["t"] * len(ids) if lps else None, lps)], *usage)


def test_same_is_exact_on_tokens_and_usage_and_near_on_logprob_values():
    a = answer([1, 2, 3], [-0.5, -1.0, -2.0])
    assert route_fuzz.same(a, answer([1, 2, 3], [-0.5, -1.0004, -2.0]))
    assert not route_fuzz.same(a, answer([1, 2, 3], [-0.5, -1.01, -2.0]))
    assert not route_fuzz.same(a, answer([1, 2, 4], [-0.5, -1.0, -2.0]))
    assert not route_fuzz.same(a, answer([1, 2, 3], [-0.5, -1.0, -2.0], usage=(4, 5)))
    assert not route_fuzz.same(a, ("error", 400, {}))
    assert route_fuzz.same(("error", 400, {"e": 1}), ("error", 400, {"e": 1}))
    # a choice with logprobs asked but no token scored: null in one answer, absent in a stream
    assert route_fuzz.same(answer([], None), ([("text", [], "length", None, [])], 3, 5))
    assert not route_fuzz.same(answer([1], [-1.0]), ([("text", [1], "length", ["t"], None)], 3, 5))


def test_cases_cover_the_parameters_and_every_route():
    rng = random.Random(0)
    cases = [route_fuzz.random_case(rng, 512) for _ in range(300)]
    seen = set().union(*(p.keys() for _, p in cases))
    assert {"seed", "top_p", "top_k", "min_p", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "logit_bias", "min_tokens", "stop", "logprobs", "echo", "ignore_eos"} <= seen
    assert any(isinstance(p, list) for p, _ in cases) and any(isinstance(p, str) for p, _ in cases)
    assert all(0 < t < 512 for p, _ in cases if isinstance(p, list) for t in p)
    assert all(p["temperature"] == 0 for _, p in (route_fuzz.random_case(rng, 512, greedy_only=True) for _ in range(50)))
    routes = route_fuzz.routes_for(rng, 20)
    assert [r["route"] for r in routes] == ["gpu", "cpu", "stage", "stage", "cpu"]
    assert 1 <= routes[3]["migrate_back_after"] == routes[4]["migrate_back_after"] < 20
