"""Malformed tools, tool choices, tool-call histories and output constraints, generated: parse()
answers each with a parsed request or an InvalidRequest (a 400 naming a field), never another
exception (which the ingress would turn into a 500)."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from keyacc_ray.errors import KeyaccError
from keyacc_ray.serve.protocol import parse
from tests.conftest import tiny_model

TOK = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
scalar = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=12)
json_value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                          max_leaves=8)
schema = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["object", "string", "integer", "array", "boolean", "nope", 5]),
    "properties": st.dictionaries(st.text(max_size=5), json_value | st.just({"type": "string"}), max_size=3),
    "required": st.lists(st.text(max_size=5), max_size=2) | json_value,
    "additionalProperties": st.booleans() | json_value, "enum": st.lists(scalar, max_size=3),
    "items": json_value, "maxLength": st.integers(-2, 20), "pattern": st.text(max_size=6)})
function = st.fixed_dictionaries({}, optional={"name": st.sampled_from(["f", "get_x", "", "bad name"]) | json_value,
                                               "description": json_value, "parameters": schema | json_value})
tool = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["function", "x"]) | json_value,
                                           "function": function | json_value}) | json_value
tool_choice = (st.sampled_from(["auto", "none", "required", "sometimes"]) | json_value
               | st.fixed_dictionaries({"type": st.just("function"),
                                        "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "get_x", "z"])})}))
response_format = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["text", "json_object", "json_schema", "xml"]) | json_value,
    "json_schema": st.fixed_dictionaries({}, optional={"name": json_value, "schema": schema | json_value}) | json_value})
call = st.fixed_dictionaries({}, optional={"id": json_value, "type": json_value, "function": st.fixed_dictionaries(
    {}, optional={"name": st.sampled_from(["f"]) | json_value, "arguments": st.text(max_size=10) | json_value}) | json_value})
message = (st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system"])},
                                 optional={"content": st.none() | st.text(max_size=10) | json_value,
                                           "tool_calls": st.lists(call, max_size=2) | json_value,
                                           "tool_call_id": json_value})
           | json_value)
body = st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.just(4)}, optional={
    "tools": st.lists(tool, max_size=3) | json_value, "tool_choice": tool_choice,
    "parallel_tool_calls": json_value, "response_format": response_format | json_value,
    "guided_json": schema | json_value, "guided_regex": st.text(max_size=8) | json_value,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | json_value,
    "guided_grammar": st.text(max_size=12) | json_value,
    "structured_outputs": st.fixed_dictionaries({}, optional={
        "json": schema | json_value, "regex": json_value, "choice": json_value, "json_object": json_value,
        "disable_any_whitespace": json_value, "whitespace_pattern": json_value}) | json_value,
    "messages": st.lists(message, min_size=1, max_size=3)})


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=body, chat=st.booleans())
def test_parse_answers_a_request_or_a_400(data, chat):
    if not chat:
        data = {k: v for k, v in data.items() if k != "messages"} | {"prompt": "hi"}
    elif "messages" not in data:
        data["messages"] = [{"role": "user", "content": "hi"}]
    try:
        parse(data, "chat" if chat else "completion", tokenizer=TOK, served_names={"m"}, max_model_len=2048)
    except KeyaccError as e:
        assert 400 <= e.status_code < 500 and str(e)
