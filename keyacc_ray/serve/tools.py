"""Tool calling, as vLLM's OpenAI server does it (no Ray, no torch).

- `parse_tools`: the request's `tools` and `tool_choice` (`none`, `auto`, `required`, or one named
  function), checked; the tools go to the model's chat template (`tools=`), which shows them to
  the model in its own format.
- `tool_choice: "auto"`: the model decides; its output is read by the tool-call parser the app
  names (`tool_call_parser`): `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  Qwen2.5 / Qwen3, Hermes and many others), `llama3_json` (Llama 3.1-3.3's JSON calls),
  `mistral` (`[TOOL_CALLS]`).
- `required` and a named function constrain decoding (a grammar, engine/structured.py), so the
  output is a valid call whatever the model: `required` a JSON array of {"name", "parameters"}
  objects of the declared tools (vLLM's form), a named function its arguments object.
- `ToolOutput`: a choice's text in, OpenAI's `content` and `tool_calls` out, whole or as stream
  deltas (`stream`: a named call's arguments as they come; other calls whole once read; text
  that may start a tag is held back until it is known not to).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from keyacc_ray.engine.structured import compile_grammar
from keyacc_ray.errors import InvalidRequest

FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128


@dataclass
class ToolRequest:
    tools: list[dict]  # OpenAI's tool objects, as the chat template gets them
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str | None = None  # for "auto"

    def function(self, name: str) -> dict | None:
        return next((t["function"] for t in self.tools if t["function"]["name"] == name), None)


def parse_tools(data: dict, parser: str | None) -> ToolRequest | None:
    """The request's tools (None: none declared, and no tool_choice that needs them)."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    parallel = data.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    clean, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'",
                                 param=f"{where}.function.name")
        if name in names:
            raise InvalidRequest(f"{where}: a second tool named {name!r}", param=f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema (an object)",
                                 param=f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
        clean.append({"type": "function", "function": {
            "name": name, **({"description": fn["description"]} if fn.get("description") else {}),
            "parameters": params if params is not None else {"type": "object", "properties": {}}}})
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                                 "{'name': ...}}", param="tool_choice")
        if name not in names:
            raise InvalidRequest(f"'tool_choice' names {name!r}, which is not among the tools", param="tool_choice")
        return ToolRequest(clean, "named", name, parallel, parser)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequest("'tool_choice' must be none, auto, required or a named function", param="tool_choice")
    if choice == "auto" and parser is None:
        raise InvalidRequest("'tool_choice': 'auto' needs a tool-call parser (tool_call_parser in the app config)",
                             param="tool_choice")
    return ToolRequest(clean, choice, None, parallel, parser)


def grammar(tr: ToolRequest, any_whitespace: bool = True) -> str | None:
    """The grammar that makes the output a valid call (required, named), else None."""
    if tr.choice == "named":
        return compile_grammar("json", tr.function(tr.name)["parameters"], param="tools",
                               any_whitespace=any_whitespace)
    if tr.choice != "required":
        return None
    one = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                             "parameters": t["function"]["parameters"]},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tr.tools]
    schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    if not tr.parallel:
        schema["maxItems"] = 1
    return compile_grammar("json", schema, param="tools", any_whitespace=any_whitespace)


def template_messages(msgs: list[dict]) -> list[dict]:
    """Assistant `tool_calls` with their arguments as objects (chat templates render them with
    tojson; vLLM does the same), for messages already checked by `check_message`."""
    out = []
    for m in msgs:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = c["function"].get("arguments")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass  # left as the string the client sent
                calls.append({**c, "function": {**c["function"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def check_message(i: int, m: dict) -> dict:
    """A `tool` message or an assistant message's `tool_calls`: what the template gets of them."""
    where = f"messages[{i}]"
    if m["role"] == "tool":
        tid = m.get("tool_call_id")
        if tid is not None and not isinstance(tid, str):
            raise InvalidRequest(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
        return {"tool_call_id": tid} if tid else {}
    calls = m.get("tool_calls")
    if calls is None:
        return {}
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    clean = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                fn.get("arguments", ""), (str, dict)):
            raise InvalidRequest(f"{where}.tool_calls[{j}] must have a function with a name and arguments",
                                 param=f"{where}.tool_calls[{j}]")
        clean.append({"id": c.get("id") if isinstance(c.get("id"), str) else f"call_{j}", "type": "function",
                      "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return {"tool_calls": clean} if clean else {}


# ---- output ----------------------------------------------------------------------------------
def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call(name: str, arguments, id_: str | None = None) -> dict:
    """One OpenAI tool call (arguments: a JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": id_ or call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _call_of(obj) -> dict | None:
    """A call from a parsed {"name", "arguments" (or "parameters")} object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return call(obj["name"], args if isinstance(args, (dict, str)) else json.dumps(args))


def _json_values(text: str, sep: str = "") -> list | None:
    """The JSON values of `text`, one after another (separated by whitespace and `sep`), or None
    if anything else is there."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in sep):
            i += 1
        if i == len(text):
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text
    (Qwen2.5 / Qwen3, Hermes 2 / 3, and many fine-tunes); what lies outside them is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEEP_SPECIAL = False  # the tags are plain text (or tokens that are not special)

    @staticmethod
    def parse_block(body: str) -> dict | None:
        try:
            return _call_of(json.loads(body))
        except ValueError:
            return None


class Llama3JsonParser:
    """Llama 3.1-3.3's JSON tool calls: the output is `{"name": ..., "parameters": {...}}`
    (after `<|python_tag|>` or at once), several separated by `;`. Text before it is not a call."""

    OPEN, CLOSE = ("<|python_tag|>", "{"), None
    AT_START = True  # a call is the whole output (after whitespace), or there is none
    KEEP_SPECIAL = True  # <|python_tag|> is a special token

    @staticmethod
    def parse_payload(text: str) -> list[dict] | None:
        text = text.removeprefix("<|python_tag|>")
        values = _json_values(text, ";")
        calls = [_call_of(v) for v in values or []]
        return calls if values and all(calls) else None


class MistralParser:
    """Mistral's `[TOOL_CALLS]` followed by a JSON array of {"name", "arguments"} (v3 tokenizers)
    or by `name[ARGS]{...}` calls (v11 and later); content may come before it."""

    OPEN, CLOSE = ("[TOOL_CALLS]",), None
    AT_START = False
    KEEP_SPECIAL = True  # [TOOL_CALLS] is a special token

    @staticmethod
    def parse_payload(text: str) -> list[dict] | None:
        parts = [x for x in text.split("[TOOL_CALLS]") if x.strip()]
        calls: list = []
        for part in parts:
            if "[ARGS]" in part:
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args)
                if not values or len(values) != 1 or not name.strip():
                    return None
                calls.append(call(name.strip(), values[0]))
                continue
            values = _json_values(part)
            if not values:
                return None
            for v in values:
                for obj in v if isinstance(v, list) else [v]:
                    c = _call_of(obj)
                    if c is None:
                        return None
                    calls.append(c)
        return calls or None


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


@dataclass
class ToolOutput:
    """One choice's output read for tool calls: feed() the text as it comes, then finish().
    Each returns (content text, [new tool calls]) to send."""

    tr: ToolRequest
    buf: str = ""
    calls: list[dict] = field(default_factory=list)
    raw: str = ""  # required / named: the whole output (a JSON value)
    gap: str = ""  # whitespace after a call, sent only if more content follows
    tail: bool = False  # a parser whose calls end the output (CLOSE None): the marker was seen
    sent: bool = False  # some content was sent (a call only at the start cannot come any more)
    named_id: str = ""  # a named call's id (its stream's deltas and the final call share it)
    named_sent: bool = False  # its first delta (with the function's name) went out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.tr.choice in ("required", "named"):
            self.raw += text
            return "", []
        if self.tr.choice != "auto":
            return text, []
        p = PARSERS[self.tr.parser]
        self.buf += text
        if p.CLOSE is None:
            return self._feed_tail(p), []
        content, new = [], []
        while True:
            start = self.buf.find(p.OPEN)
            if start < 0:  # hold back a tail that may be the start of a tag
                keep = _partial_tail(self.buf, p.OPEN)
                content.append(self._content(self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
                break
            end = self.buf.find(p.CLOSE, start + len(p.OPEN))
            if end < 0:
                content.append(self._content(self.buf[:start]))
                self.buf = self.buf[start:]
                break
            got = p.parse_block(self.buf[start + len(p.OPEN):end].strip())
            if got is None:  # not a call: it is content, as written
                content.append(self._content(self.buf[:end + len(p.CLOSE)]))
            else:
                content.append(self._content(self.buf[:start]))
                new.append(got)
                self.calls.append(got)
            self.buf = self.buf[end + len(p.CLOSE):]
        return "".join(content), new

    def _feed_tail(self, p) -> str:
        """A parser whose calls run to the end of the output: content until its marker (held
        back while the text may still become one), then everything is kept for finish()."""
        if self.tail:
            return ""
        if p.AT_START:
            if self.sent:
                out, self.buf = self.buf, ""
                return out
            head = self.buf.lstrip()
            if any(head.startswith(m) for m in p.OPEN):
                self.tail, self.buf = True, head
                return ""
            if not head or any(m.startswith(head) for m in p.OPEN):
                return ""  # whitespace, or the start of a marker: wait
            out, self.buf, self.sent = self.buf, "", True
            return out
        at = min((i for i in (self.buf.find(m) for m in p.OPEN) if i >= 0), default=-1)
        if at >= 0:
            out, self.buf, self.tail = self.buf[:at], self.buf[at:], True
            return out
        keep = max(_partial_tail(self.buf, m) for m in p.OPEN)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def _content(self, piece: str) -> str:
        """Text outside the calls: after a call, whitespace waits until more content follows
        (the line breaks between and after calls are not content)."""
        if not self.calls:
            return piece
        if not piece.strip():
            self.gap += piece
            return ""
        piece, self.gap = self.gap + piece, ""
        return piece

    def finish(self) -> tuple[str, list[dict]]:
        """The rest: an unclosed block is content (the output was cut); required / named output
        becomes its calls."""
        if self.tr.choice == "named":
            new = [call(self.tr.name, self.raw, self._named_id())] if self.raw.strip() else []
        elif self.tr.choice == "required":
            new = []
            try:
                items = json.loads(self.raw)
            except ValueError:  # cut by max_tokens or a stop string: sent as content
                return self.raw, []
            for it in items if isinstance(items, list) else []:
                if isinstance(it, dict) and isinstance(it.get("name"), str):
                    new.append(call(it["name"], it.get("parameters", {})))
        else:
            if self.tr.choice == "auto" and self.buf and PARSERS[self.tr.parser].CLOSE is None:
                p, rest, self.buf = PARSERS[self.tr.parser], self.buf, ""
                got = p.parse_payload(rest) if self.tail else None
                if got is None:  # not calls after all (or cut short): content, as written
                    return rest, []
                self.calls += got
                return "", got
            if self.tr.choice == "auto" and self.buf:
                p = PARSERS[self.tr.parser]
                if self.buf.startswith(p.OPEN) and (got := p.parse_block(self.buf[len(p.OPEN):].strip())):
                    self.buf, new = "", [got]  # a closing tag left out before the end
                    self.calls.append(got)
                    return "", new
            rest, self.buf = self._content(self.buf), ""
            return rest, []
        self.calls += new
        return "", new

    def _named_id(self) -> str:
        if not self.named_id:
            self.named_id = call_id()
        return self.named_id

    def stream(self, text: str, last: bool) -> tuple[str, list[dict] | None]:
        """A streamed chunk's text: (content to send, OpenAI tool_calls deltas, each with its
        `index`). A named call streams its arguments as they come (its first delta names the
        function, the next ones carry more of the arguments, as vLLM and OpenAI stream them);
        other calls go whole, once read."""
        before = len(self.calls)
        content, _ = self.feed(text)
        deltas: list[dict] = []
        if self.tr.choice == "named" and text:
            if not self.named_sent:
                self.named_sent = True
                deltas.append({"index": 0, "id": self._named_id(), "type": "function",
                               "function": {"name": self.tr.name, "arguments": text}})
            else:
                deltas.append({"index": 0, "function": {"arguments": text}})
        if last:
            content += self.finish()[0]
        if self.tr.choice != "named":
            deltas += [{"index": before + j, **c} for j, c in enumerate(self.calls[before:])]
        return content, deltas or None

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: tool_calls where the model called tools (a forced named call ends in stop)."""
        if self.calls and reason == "stop" and self.tr.choice in ("auto", "required"):
            return "tool_calls"
        return reason


def _partial_tail(s: str, tag: str) -> int:
    """How many of s's last characters are a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0
