"""Random chat requests for the cross-route fuzzer (`route_fuzz.run(..., api="chat")`).

Each case is a conversation (a system or developer message or none, one to three user turns,
earlier assistant answers, an earlier tool call with its result, content as a string or as text
parts) with a random mix of what a chat client asks for: tools with `tool_choice` auto, required,
none or named (and `parallel_tool_calls` off), or a `response_format` (json_object or a small
json_schema), or vLLM's `structured_outputs` choice or regex; sampling, penalties, a logit bias,
stops, `logprobs` with `top_logprobs`, n. The answer compared across routes is, per choice, the
content, the tool calls (name and argument text; their ids are random by design), the finish
reason, the logprob tokens, their values and the alternatives' values (within the fuzzer's
tolerance), and the usage. Plain Python and httpx."""
from __future__ import annotations

import json
import random

import httpx

from keyacc_ray.bench import route_fuzz

# small schemas: a random model spends about a token per character of its arguments
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {"tz": {"enum": ["UTC", "CET"]}}}}},
    {"type": "function", "function": {"name": "lookup", "description": "Search a term", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["q", "n"],
        "properties": {"q": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}}}}},
]
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["city", "days"],
     "properties": {"city": {"type": "string", "maxLength": 6},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14}}},
    {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
]


def _text(rng: random.Random, words: tuple, most: int) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, most)))


def _content(rng: random.Random, words: tuple, most: int):
    text = _text(rng, words, most)
    if rng.random() < 0.2:  # text parts, as the OpenAI client sends multi-part content
        cut = rng.randint(0, len(text))
        return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]
    return text


def random_case(rng: random.Random, vocab: int, words: tuple, greedy_only: bool = False) -> tuple:
    """(messages, params) of one chat case; short texts and at most two tools, so that the
    conversation fits a small context (the tools' JSON goes into the prompt)."""
    msgs: list[dict] = []
    if rng.random() < 0.4:
        msgs.append({"role": rng.choice(["system", "system", "developer"]), "content": _text(rng, words, 8)})
    tools = rng.sample(TOOLS, rng.randint(1, 2)) if rng.random() < 0.4 else None
    for turn in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": _content(rng, words, 12)})
        if turn == 0 and tools and rng.random() < 0.4:  # an earlier call and its result in the history
            fn = tools[0]["function"]["name"]
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{turn}", "type": "function", "function": {"name": fn, "arguments": "{}"}}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{turn}",
                         "content": json.dumps({"v": rng.randint(0, 99)})})
            msgs.append({"role": "assistant", "content": _text(rng, words, 6)})
        elif rng.random() < 0.5:
            msgs.append({"role": "assistant", "content": _text(rng, words, 8)})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": _content(rng, words, 10)})
    p: dict = {"max_tokens": rng.randint(1, 50)}
    if tools:
        p["tools"] = tools
        choice = rng.choice(["auto", "required", "required", "named", "named", "none", None])
        if choice == "named":
            p["tool_choice"] = {"type": "function", "function": {"name": rng.choice(tools)["function"]["name"]}}
        elif choice:
            p["tool_choice"] = choice
        if choice in ("required", "named"):
            p["max_tokens"] = rng.randint(40, 120)  # room for a whole call, most of the time
        if rng.random() < 0.3:
            p["parallel_tool_calls"] = False
    elif rng.random() < 0.35:
        kind = rng.choice(["json_object", "json_schema", "json_schema", "choice", "regex"])
        p["max_tokens"] = rng.randint(10, 90)
        if kind == "json_object":
            p["response_format"] = {"type": "json_object"}
        elif kind == "json_schema":
            p["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "out", "schema": rng.choice(SCHEMAS), "strict": True}}
        elif kind == "choice":
            p["structured_outputs"] = {"choice": rng.sample(["yes", "no", "maybe", "later"], rng.randint(2, 4))}
        else:
            p["structured_outputs"] = {"regex": r"[a-c]{1,4}-[0-9]{2}"}
    p.update(route_fuzz.random_sampling(rng, vocab, greedy_only))
    if rng.random() < 0.15 and "tools" not in p:
        p["stop"] = [rng.choice(words) for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.3:
        p["logprobs"] = True
        p["top_logprobs"] = rng.choice([0, 1, 3])
    return msgs, p


def _lp(entries: list | None) -> tuple:
    """(tokens, values, the alternatives' values per token sorted) of a choice's logprobs content."""
    if not entries:  # none asked, or no token scored (absent in a stream)
        return None, None, None
    return ([e["token"] for e in entries], [e["logprob"] for e in entries],
            [sorted((t["logprob"] for t in e.get("top_logprobs") or []), reverse=True) for e in entries])


def _calls(calls: list | None) -> tuple | None:
    return tuple((c["function"]["name"], c["function"]["arguments"]) for c in calls) if calls else None


def ask(client: httpx.Client, base: str, body: dict):
    """One chat request's comparable answer (the shape `route_fuzz.same` compares): (per choice
    (content, tool calls, finish, logprob tokens, logprob values, alternatives' values),
    completion tokens, prompt tokens), or ("error", status, body)."""
    if not body["stream"]:
        r = client.post(f"{base}/v1/chat/completions", json=body)
        if r.status_code != 200:
            return ("error", r.status_code, r.json())
        j = r.json()
        out = {}
        for c in j["choices"]:
            lp = _lp((c.get("logprobs") or {}).get("content"))
            msg = c["message"]
            out[c["index"]] = (msg.get("content") or None, _calls(msg.get("tool_calls")), c["finish_reason"], *lp)
        return ([out[k] for k in sorted(out)], j["usage"]["completion_tokens"], j["usage"]["prompt_tokens"])
    events = route_fuzz.sse_events(client, f"{base}/v1/chat/completions", body)
    if isinstance(events, tuple):  # ("error", status, body)
        return events
    text: dict = {}
    calls: dict = {}
    fin: dict = {}
    lps: dict = {}
    seen: set = set()
    for j in events:
        for c in j["choices"]:
            k = c["index"]
            seen.add(k)
            d = c.get("delta") or {}
            if d.get("content") is not None:
                text[k] = text.get(k, "") + d["content"]
            for tc in d.get("tool_calls") or []:
                got = calls.setdefault(k, {}).setdefault(tc["index"], ["", ""])
                got[0] += (tc.get("function") or {}).get("name") or ""
                got[1] += (tc.get("function") or {}).get("arguments") or ""
            fin[k] = c.get("finish_reason") or fin.get(k)
            if c.get("logprobs") and c["logprobs"].get("content") is not None:
                lps.setdefault(k, []).extend(c["logprobs"]["content"])
    out = {}
    for k in seen:
        tcs = tuple(tuple(v) for _, v in sorted(calls[k].items())) if k in calls else None
        out[k] = (text.get(k) or None, tcs, fin.get(k), *_lp(lps.get(k)))
    return ([out[k] for k in sorted(out)], *route_fuzz.usage_of(events))
