"""Structured outputs and tool calling through real Ray Serve and HTTP with the official openai
client, on the random-weight tiny model: the grammar, not the model, makes the output valid, on
every route (gpu, cpu, stage, and stage with the decode moved back), whole and streamed; an
agent-style loop (tools declared, a call returned, its result sent back, a final answer)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "tiny-qwen3"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "units"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "units": {"enum": ["metric", "imperial"]}}}
# (small: the tiny model's tokenizer spends about a token per character, and its context is 768)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Forecast",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {"tz": {"enum": ["UTC", "CET"]}}}}}
ROUTES = [{"route": "gpu"}, {"route": "cpu"}, {"route": "stage"}, {"route": "stage", "migrate_back_after": 4}]


@pytest.fixture(scope="module")
def client(app_url):
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", timeout=120, max_retries=0)


def segments(resp_or_chunk) -> list[str]:
    trace = (resp_or_chunk.model_extra or {}).get("keyacc") or {}
    return [s["pool"] for s in trace.get("segments", [])]


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "+back" if "migrate_back_after" in r else r["route"])
def test_json_schema_validates_on_every_route(client, route):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "Forecast request for Paris as JSON."}]
    for seed, temp in ((0, 0.0), (1, 1.0), (2, 1.2)):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=temp, seed=seed,
                                           response_format=fmt, extra_body={"keyacc": route})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        if "migrate_back_after" in route:
            assert segments(r) == ["gpu", "cpu", "gpu"]
    text, last = "", None
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=0.9, seed=5,
                                             response_format=fmt, stream=True, extra_body={"keyacc": route}):
        for c in ch.choices:
            text += c.delta.content or ""
            last = c.finish_reason or last
    assert last == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_other_constraints_on_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="Sentiment:", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"guided_choice": ["positive", "negative", "neutral"]})
    assert r.choices[0].text in ("positive", "negative", "neutral")
    r = client.completions.create(model=MODEL, prompt="A date:", max_tokens=30, temperature=1.0, seed=4,
                                  extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
                                              "keyacc": {"route": "cpu"}})
    assert len(r.choices[0].text) == 10 and r.choices[0].text.startswith("20")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "any JSON object"}],
                                       max_tokens=300, temperature=0, response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": None})
    if r.choices[0].finish_reason == "stop":  # any object: a random model may not close it in 300 tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "frob"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("route", ROUTES[:3], ids=lambda r: r["route"])
def test_required_tool_choice_returns_a_valid_call(client, route):
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK], tool_choice="required",
                                       max_tokens=250, temperature=0.8, seed=2, extra_body={"keyacc": route})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": CLOCK["function"]["parameters"]}
    for name, args in calls_of(c.message):
        jsonschema.validate(args, schemas[name])
    # streamed: the calls arrive as tool_calls deltas, accumulated as clients do
    calls, finish = {}, None
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK],
                                             tool_choice="required", max_tokens=250, temperature=0.8, seed=2,
                                             stream=True, extra_body={"keyacc": route}):
        for ch_c in ch.choices:
            finish = ch_c.finish_reason or finish
            for d in ch_c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == calls_of(c.message)


def test_named_tool_choice_and_parallel_off(client):
    msgs = [{"role": "user", "content": "time?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK], max_tokens=100,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       temperature=1.0, seed=9)
    (name, args), = calls_of(r.choices[0].message)
    assert name == "get_time" and args.get("tz", "UTC") in ("UTC", "CET")
    # streamed: the named call's arguments arrive as they are generated, under one id
    got, finish, ids = {"name": "", "arguments": ""}, None, set()
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK], max_tokens=100,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}},
                                             temperature=1.0, seed=9, stream=True):
        for c in ch.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                ids |= {d.id} if d.id else set()
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
    assert finish == "stop" and len(ids) == 1
    assert got["name"] == "get_time" and json.loads(got["arguments"]) == args
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=250, temperature=1.0, seed=4)
    assert len(r.choices[0].message.tool_calls) == 1


def test_agent_loop(client):
    """The loop an agent framework runs: tools declared, the model calls one, the client runs it
    and sends the result back with the call in the history, the model answers."""
    msgs = [{"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": "Should I take an umbrella in Bergen tomorrow?"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required",
                                           max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))  # as clients append it
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"rain_mm": 12, "temp_c": 9})})
    final = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=20, temperature=0)
    c = final.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls  # (a random model: what it says is not checked)
    assert final.usage.prompt_tokens > first.usage.prompt_tokens
