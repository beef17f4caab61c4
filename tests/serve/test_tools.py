"""Tool calling and output constraints without Ray: request checks, the chat template's tools,
the Hermes parser whole and streamed (any split of the text gives the same calls and content),
and the grammars that force a call."""
import json
import random

import pytest
from transformers import AutoTokenizer

from keyacc_ray.errors import InvalidRequest
from keyacc_ray.serve import constraints
from keyacc_ray.serve.protocol import parse
from keyacc_ray.serve.tools import ToolOutput, ToolRequest, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tok(qwen3_path):
    return AutoTokenizer.from_pretrained(qwen3_path)


def chat(tok, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], **extra}
    return parse(body, "chat", tokenizer=tok, served_names={"m"}, max_model_len=1024)


def test_tools_reach_the_template_and_choices_parse(tok):
    p = chat(tok, tools=[WEATHER, TIME])
    assert p.tools.choice == "auto" and p.request.params["grammar"] is None
    prompt = tok.decode(p.request.prompt_token_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt and '"get_time"' in prompt
    assert chat(tok, tools=[WEATHER], tool_choice="none").tools.choice == "none"
    req = chat(tok, tools=[WEATHER, TIME], tool_choice="required")
    assert req.tools.choice == "required" and req.request.params["grammar"]
    named = chat(tok, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tools.name == "get_time" and named.request.params["grammar"]
    assert chat(tok).tools is None and "<tools>" not in tok.decode(chat(tok).request.prompt_token_ids)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400s(tok, extra, param):
    with pytest.raises(InvalidRequest) as e:
        chat(tok, **extra)
    assert e.value.status_code == 400 and e.value.param == param


def test_auto_needs_a_parser_and_completions_take_no_tools(tok):
    with pytest.raises(InvalidRequest, match="tool-call parser"):
        parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}, "chat",
              tokenizer=tok, served_names={"m"}, max_model_len=1024, tool_parser=None)
    ok = parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                "tool_choice": "required"}, "chat", tokenizer=tok, served_names={"m"}, max_model_len=1024,
               tool_parser=None)
    assert ok.tools.choice == "required"
    with pytest.raises(InvalidRequest) as e:
        parse({"model": "m", "prompt": "x", "tools": [WEATHER]}, "completion", tokenizer=tok, served_names={"m"},
              max_model_len=256)
    assert e.value.param == "tools"


def test_history_with_tool_calls_and_results(tok):
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    p = parse({"model": "m", "messages": msgs, "tools": [WEATHER]}, "chat", tokenizer=tok, served_names={"m"},
              max_model_len=1024)
    prompt = tok.decode(p.request.prompt_token_ids)
    # the arguments reach the template as an object (rendered as JSON, not as a quoted string)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in prompt
    for bad, param in (({"role": "assistant", "tool_calls": "x"}, "messages[1].tool_calls"),
                       ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
                        "messages[1].tool_calls[0]"),
                       ({"role": "tool", "tool_call_id": 5, "content": "x"}, "messages[1].tool_call_id")):
        with pytest.raises(InvalidRequest) as e:
            parse({"model": "m", "messages": [msgs[0], bad]}, "chat", tokenizer=tok, served_names={"m"},
                  max_model_len=1024)
        assert e.value.param == param


AUTO = ToolRequest([WEATHER, TIME], "auto", parser="hermes")
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def whole(tr, text):
    out = ToolOutput(tr)
    a, _ = out.feed(text)
    b, _ = out.finish()
    return a + b, out.calls, out


def streamed(tr, text, seed):
    rng, out, content, pos = random.Random(seed), ToolOutput(tr), "", 0
    while pos < len(text):
        step = rng.randint(1, 7)
        content += out.feed(text[pos:pos + step])[0]
        pos += step
    content += out.finish()[0]
    return content, out.calls


def plain(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_calls_whole_and_streamed_in_any_split():
    content, calls, out = whole(AUTO, TEXT)
    assert content == "Let me check.\n"
    assert plain(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    for seed in range(20):
        s_content, s_calls = streamed(AUTO, TEXT, seed)
        assert s_content == content and plain(s_calls) == plain(calls)


@pytest.mark.parametrize("text, content, n_calls", [
    ("no tools here, just <tool talk", "no tools here, just <tool talk", 0),
    ("<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", 0),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', "", 1),  # cut before its closing tag
    ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', 0),  # cut mid-call
    ("a < b and <tool_ca", "a < b and <tool_ca", 0),
])
def test_hermes_edge_cases(text, content, n_calls):
    got, calls, _ = whole(AUTO, text)
    assert got == content and len(calls) == n_calls
    for seed in range(5):
        assert streamed(AUTO, text, seed) [0] == content


def test_none_required_and_named_outputs():
    assert whole(ToolRequest([WEATHER], "none"), TEXT)[:2] == (TEXT, [])
    req = ToolRequest([WEATHER, TIME], "required")
    content, calls, out = whole(req, '[{"name": "get_time", "parameters": {}}, '
                                     '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert content == "" and plain(calls) == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert out.finish_reason("stop") == "tool_calls"
    assert whole(req, '[{"name": "get_ti')[:2] == ('[{"name": "get_ti', [])  # cut: content, no call
    named = ToolRequest([WEATHER], "named", "get_weather")
    content, calls, out = whole(named, '{"city": "Rome"}')
    assert content == "" and plain(calls) == [("get_weather", {"city": "Rome"})]
    assert out.finish_reason("stop") == "stop"  # OpenAI: a forced call ends in stop


def test_constraint_fields():
    assert constraints.requested({}) is None
    assert constraints.requested({"response_format": {"type": "text"}}) is None
    assert constraints.requested({"response_format": {"type": "json_object"}})[0] == "json_object"
    kind, spec, param, _ = constraints.requested({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}})
    assert (kind, spec, param) == ("json", {"type": "object"}, "response_format.json_schema.schema")
    assert constraints.requested({"guided_regex": "a+"})[:3] == ("regex", "a+", "guided_regex")
    so = constraints.requested({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}})
    assert so[:3] == ("choice", ["a", "b"], "structured_outputs.choice") and so[3]["any_whitespace"] is False
    for bad, param in (({"response_format": {"type": "xml"}}, "response_format.type"),
                       ({"response_format": "json"}, "response_format"),
                       ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs.regex"),
                       ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
                       ({"guided_json": {}, "response_format": {"type": "json_object"}}, "guided_json"),
                       ({"guided_regex": "a", "guided_decoding_backend": "magic"}, "guided_decoding_backend")):
        with pytest.raises(InvalidRequest) as e:
            constraints.grammar_of(bad)
        assert e.value.param == param, bad
    compact = constraints.grammar_of({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}})
    assert compact and compact != constraints.grammar_of({"guided_json": {"type": "object"}})


@pytest.mark.parametrize("parser, text, content, want", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
                    '{"city": "Oslo"}}', "", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ("llama3_json", "  It is sunny. {\"name\": \"x\"}", "  It is sunny. {\"name\": \"x\"}", []),  # not at the start
    ("llama3_json", '{"name": "get_time", "param', '{"name": "get_time", "param', []),  # cut: content
    ("llama3_json", '{"a": 1} and more', '{"a": 1} and more', []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Sure.",
     [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Bonn"}', "",
     [("get_time", {}), ("get_weather", {"city": "Bonn"})]),
    ("mistral", "no calls [TOOL_CA", "no calls [TOOL_CA", []),
    ("mistral", "[TOOL_CALLS][{\"name\": 3}]", "[TOOL_CALLS][{\"name\": 3}]", []),
])
def test_llama3_json_and_mistral_parsers(parser, text, content, want):
    tr = ToolRequest([WEATHER, TIME], "auto", parser=parser)
    got, calls, _ = whole(tr, text)
    assert got == content and plain(calls) == want
    for seed in range(10):
        s_content, s_calls = streamed(tr, text, seed)
        assert s_content == content and plain(s_calls) == want


def test_parsers_that_read_special_tokens_keep_them(tok):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    for parser, keep in (("hermes", True), ("mistral", False), ("llama3_json", False)):
        p = parse(dict(body), "chat", tokenizer=tok, served_names={"m"}, max_model_len=1024, tool_parser=parser)
        assert p.request.params["skip_special_tokens"] is keep
    p = parse({**body, "skip_special_tokens": True}, "chat", tokenizer=tok, served_names={"m"}, max_model_len=1024,
              tool_parser="mistral")
    assert p.request.params["skip_special_tokens"] is True


def test_streamed_deltas_accumulate_to_the_calls():
    """What a client accumulates from the deltas equals the whole response's calls: a named call
    streamed argument by argument (one id, the name first), other calls whole."""
    def accumulate(tr, text, seed):
        rng, out, pos, got, content = random.Random(seed), ToolOutput(tr), 0, {}, ""
        while pos < len(text):
            step = rng.randint(1, 6)
            piece, pos = text[pos:pos + step], pos + step
            c, deltas = out.stream(piece, pos >= len(text))
            content += c
            for d in deltas or []:
                g = got.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
                g["id"] = d.get("id") or g["id"]
                g["name"] += d.get("function", {}).get("name") or ""
                g["arguments"] += d.get("function", {}).get("arguments") or ""
        return content, [got[i] for i in sorted(got)], out
    named = ToolRequest([WEATHER], "named", "get_weather")
    args = '{"city": "Rome, Italy"}'
    for seed in range(8):
        content, got, out = accumulate(named, args, seed)
        assert content == "" and got == [{"id": out.calls[0]["id"], "name": "get_weather", "arguments": args}]
    for seed in range(8):
        content, got, out = accumulate(AUTO, TEXT, seed)
        assert content == "Let me check.\n"
        assert [(g["name"], json.loads(g["arguments"])) for g in got] == plain(out.calls) and len(got) == 2
