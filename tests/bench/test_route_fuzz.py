"""The cross-route fuzzer's own logic: its cases and its comparison (the e2e run is in
tests/e2e/test_openai_api.py)."""
import json
import random

import httpx

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


def test_chat_cases_cover_conversations_tools_and_formats():
    from keyacc_ray.bench import chat_fuzz

    rng = random.Random(1)
    cases = [chat_fuzz.random_case(rng, 512, route_fuzz.WORDS) for _ in range(400)]
    seen = set().union(*(p.keys() for _, p in cases))
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs", "logprobs",
            "top_logprobs", "n", "seed", "stop", "logit_bias"} <= seen
    choices = {json.dumps(p.get("tool_choice")) for _, p in cases if "tools" in p}
    assert {'"auto"', '"required"', '"none"', "null"} <= choices and any("function" in c for c in choices)
    assert {p["response_format"]["type"] for _, p in cases if "response_format" in p} == {"json_object", "json_schema"}
    roles = set().union(*({m["role"] for m in msgs} for msgs, _ in cases))
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    assert all(msgs[-1]["role"] == "user" for msgs, _ in cases)
    assert any(isinstance(m["content"], list) for msgs, _ in cases for m in msgs)
    # a named tool is one of the tools declared; a tool result follows its call
    for msgs, p in cases:
        if isinstance(p.get("tool_choice"), dict):
            assert p["tool_choice"]["function"]["name"] in {t["function"]["name"] for t in p["tools"]}
        for i, m in enumerate(msgs):
            if m["role"] == "tool":
                assert msgs[i - 1]["tool_calls"][0]["id"] == m["tool_call_id"]


def _chat_server(request: httpx.Request) -> httpx.Response:
    """One answer with two choices (a tool call; text with logprobs), whole or as SSE deltas."""
    lp = [{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5},
                                                            {"token": "b", "logprob": -1.5}]},
          {"token": "c", "logprob": -0.25, "top_logprobs": []}]
    if not json.loads(request.content)["stream"]:
        return httpx.Response(200, json={"choices": [
            {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "x1", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}]},
             "finish_reason": "tool_calls", "logprobs": None},
            {"index": 1, "message": {"role": "assistant", "content": "ac"}, "finish_reason": "length",
             "logprobs": {"content": lp}}], "usage": {"completion_tokens": 7, "prompt_tokens": 9}})
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}, {"index": 1, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "x2", "function": {"name": "f",
                                                                                              "arguments": '{"q"'}}]}}]},
        {"choices": [{"index": 1, "delta": {"content": "a"}, "logprobs": {"content": lp[:1]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': 1}'}}]}}]},
        {"choices": [{"index": 1, "delta": {"content": "c"}, "logprobs": {"content": lp[1:]}, "finish_reason": "length"}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"completion_tokens": 7, "prompt_tokens": 9}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})


def test_a_chat_answer_whole_and_streamed_compare_equal():
    from keyacc_ray.bench import chat_fuzz

    with httpx.Client(transport=httpx.MockTransport(_chat_server)) as c:
        whole = chat_fuzz.ask(c, "http://x", {"stream": False})
        streamed = chat_fuzz.ask(c, "http://x", {"stream": True})
    assert whole[0][0][:3] == (None, (("f", '{"q": 1}'),), "tool_calls")
    assert whole[0][1] == ("ac", None, "length", ["a", "c"], [-0.5, -0.25], [[-0.5, -1.5], []])
    assert route_fuzz.same(streamed, whole)
    # an argument, an alternative's value or the usage that differs is a mismatch
    other = ([whole[0][0], (*whole[0][1][:5], [[-0.5, -1.6], []])], 7, 9)
    assert not route_fuzz.same(other, whole)
    other = ([(None, (("f", '{"q": 2}'),), "tool_calls", None, None, None), whole[0][1]], 7, 9)
    assert not route_fuzz.same(other, whole)
    assert not route_fuzz.same((whole[0], 8, 9), whole)
