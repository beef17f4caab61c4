"""OpenAI request parsing and response shapes. Plain Python: JSON in, typed request out, and a
clear `InvalidRequest` (400) naming the offending parameter for anything malformed."""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

from keyacc_ray.engine.request import MAX_LOGPROBS, MAX_SEED, SamplingParams
from keyacc_ray.errors import InvalidRequest, ModelNotFound
from keyacc_ray.serve import constraints, tools
from keyacc_ray.serve.messages import GenerateRequest, TokenChunk

# Accepted only at their neutral values; anything else is refused rather than silently ignored.
NEUTRAL = {"functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""),
           # vLLM's extensions this server does not implement
           "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "bad_words": (None, []),
           "allowed_token_ids": (None,), "logits_processors": (None,),
           "truncate_prompt_tokens": (None,), "spaces_between_special_tokens": (None, True),
           "chat_template": (None,), "documents": (None,)}


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # the last: vLLM's extension
# Every field parse() reads (besides NEUTRAL's); another field is ignored and named (`ignored_fields`),
# as vLLM warns "fields were present in the request but ignored". `user`: OpenAI's, accepted and unused.
READ_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "best_of", "echo", "max_tokens", "max_completion_tokens", "logprobs",
    "top_logprobs", "prompt_logprobs", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "min_tokens", "logit_bias", "stream",
    "stream_options", "return_token_ids", "keyacc", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "chat_template_kwargs", "user", *PENALTIES, *constraints.FIELDS, *tools.FIELDS})


def ignored_fields(data: dict) -> list[str]:
    """The request's fields this server neither reads nor refuses (sorted)."""
    return sorted(k for k in data if k not in READ_FIELDS and k not in NEUTRAL)
# What a model's generation_config.json may set as the server's defaults (vLLM's --generation-config
# auto): these, and max_new_tokens as the default max_tokens.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_CHOICES = 64  # choices per HTTP request: prompts (a completions batch) x n


@dataclass
class ParsedRequest:
    kind: str  # "completion" or "chat"
    requests: list[GenerateRequest]  # one per choice, in choice order (prompt-major, then n)
    stream: bool
    include_usage: bool
    model: str
    return_token_ids: bool = False
    response_id: str = ""
    num_prompt_tokens: int = 0  # usage: every prompt once, whatever n is
    # completions `echo`: per choice, its prompt's text, which the choice's text starts with (and,
    # with logprobs, its tokens' scores); `echo_only`: max_tokens 0, the prompt and nothing else
    echo: list[str] | None = None
    echo_only: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    prompt_logprobs: int | None = None  # vLLM's extension: each prompt token's logprob and this many alternatives
    n: int = 1  # choices per prompt
    tools: tools.ToolRequest | None = None  # chat: the declared tools (their calls are read from the output)

    @property
    def request(self) -> GenerateRequest:
        """The first choice's request (the only one, unless the client asked for several)."""
        return self.requests[0]


def _type(v, types, name, what):
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise InvalidRequest(f"'{name}' must be {what}, got {type(v).__name__}", param=name)
    return v


def load_json(body: bytes, max_bytes: int) -> dict:
    if len(body) > max_bytes:
        raise InvalidRequest(f"request body of {len(body)} bytes exceeds the limit of {max_bytes}", code="body_too_large")
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e.msg} at position {e.pos}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def client_request_id(value: str | None) -> str | None:
    """The `X-Request-Id` header's value, if the request has one: 1-128 letters, digits, `.`, `_`,
    `:` or `-` (it goes into the response's id and the server's logs); else a 400."""
    if value is None:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise InvalidRequest("the X-Request-Id header must be 1-128 characters of letters, digits, '.', '_', "
                             "':' or '-'", param="X-Request-Id")
    return value


def parse(data: dict, kind: str, *, tokenizer, served_names: set[str], max_model_len: int,
          allow_pinning: bool = True, vocab_size: int | None = None, defaults: dict | None = None,
          tool_parser: str | None = "hermes", request_id: str | None = None) -> ParsedRequest:
    """`request_id`: the client's own id for the request (vLLM's `X-Request-Id` header): the
    response's id is `cmpl-<it>` (`chatcmpl-<it>`); inside the graph each choice's id also carries a
    random part (two clients may send the same one). `vocab_size`: len(tokenizer), which the
    caller should compute once (transformers rebuilds the whole vocabulary to answer it: about a
    millisecond per call). `defaults`: sampling
    parameters for the fields a request leaves out or sends as null (`generation_defaults`).
    `tool_parser`: how `tool_choice: auto` reads calls from the output (tools.PARSERS; None: off)."""
    defaults = defaults or {}
    model = data.get("model")
    if model is None:
        raise InvalidRequest("'model' is required", param="model")
    _type(model, (str,), "model", "a string")
    if model not in served_names:
        raise ModelNotFound(f"the model '{model}' does not exist; this server serves {sorted(served_names)}",
                            param="model", code="model_not_found")
    for k, ok in NEUTRAL.items():
        if k in data and data[k] not in ok:
            raise InvalidRequest(f"'{k}'={data[k]!r} is not supported by this server", param=k,
                                 code="unsupported_parameter")

    n = _num_choices(data)
    if kind == "chat":
        tool_req = tools.parse_tools(data, tool_parser)
        prompts = [_chat_prompt(data, tokenizer, tool_req.tools if tool_req else None)]
    else:
        if data.get("tools") or data.get("tool_choice") not in (None, "none"):
            raise InvalidRequest("tools are for /v1/chat/completions", param="tools", code="unsupported_parameter")
        tool_req, prompts = None, _completion_prompts(data, tokenizer)
    grammar = constraints.grammar_of(data)
    tool_grammar = tools.grammar(tool_req) if tool_req else None
    if grammar and tool_grammar:
        raise InvalidRequest(f"tool_choice {tool_req.choice!r} constrains the output already; send no other "
                             "output constraint with it", param="tool_choice")
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompt(s) x n={n} is over {MAX_CHOICES} choices per request",
                             param="n", code="too_many_choices")
    where = "messages" if kind == "chat" else "prompt"
    vocab = len(tokenizer) if vocab_size is None else vocab_size
    for prompt_ids in prompts:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param=where)
        if len(prompt_ids) >= max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_model_len}",
                                 param=where, code="context_length_exceeded")
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
    longest = max(len(ids) for ids in prompts)

    echo = data.get("echo")
    if echo is not None and echo is not False and kind == "chat":
        raise InvalidRequest(f"'echo'={echo!r} is not supported by this server", param="echo",
                             code="unsupported_parameter")
    echo = bool(echo is not None and _type(echo, (bool,), "echo", "a boolean"))
    max_tokens = data.get("max_tokens")
    if kind == "chat" and data.get("max_completion_tokens") is not None:  # a null one does not hide max_tokens
        max_tokens = data["max_completion_tokens"]
    if max_tokens is None:
        max_tokens = 16 if kind == "completion" else max_model_len - longest
        max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))
    _type(max_tokens, (int,), "max_tokens", "an integer")
    echo_only = echo and max_tokens == 0  # as vLLM: one token is made and dropped
    if echo_only:
        max_tokens = 1
    if max_tokens < 1:
        raise InvalidRequest(f"'max_tokens' must be at least 1 (0 only with echo), got {max_tokens}",
                             param="max_tokens")
    if longest + max_tokens > max_model_len:
        raise InvalidRequest(f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"of {max_model_len} tokens", param="max_tokens", code="context_length_exceeded")

    logprobs = _logprobs(data, kind)
    prompt_logprobs = _prompt_logprobs(data)
    scored = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]
    given = {k: data[k] for k in SAMPLING_DEFAULTS if data.get(k) is not None}
    temperature = _type(given.get("temperature", defaults.get("temperature", 1.0)), (int, float), "temperature",
                        "a number")
    top_p = _type(given.get("top_p", defaults.get("top_p", 1.0)), (int, float), "top_p", "a number")
    top_k = _type(given.get("top_k", defaults.get("top_k", 0)), (int,), "top_k", "an integer")
    min_p = _type(given.get("min_p", defaults.get("min_p", 0.0)), (int, float), "min_p", "a number")
    seed = data.get("seed")
    if seed is not None:
        _type(seed, (int,), "seed", "an integer")
    stop = data.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    _type(stop, (list,), "stop", "a string or a list of strings")
    stop_token_ids = data.get("stop_token_ids") or []
    _type(stop_token_ids, (list,), "stop_token_ids", "a list of integers")
    ignore_eos = data.get("ignore_eos", False)
    _type(ignore_eos, (bool,), "ignore_eos", "a boolean")
    text_opts = {k: _type(data[k], (bool,), k, "a boolean") for k in ("include_stop_str_in_output", "skip_special_tokens")
                 if data.get(k) is not None}
    if tool_req is not None and tool_req.choice == "auto" and tools.PARSERS[tool_req.parser].KEEP_SPECIAL:
        text_opts.setdefault("skip_special_tokens", False)  # the parser reads a special token (as vLLM)
    min_tokens = data.get("min_tokens")
    min_tokens = 0 if min_tokens is None else _type(min_tokens, (int,), "min_tokens", "an integer")
    penalties = {k: _type(data[k], (int, float), k, "a number") for k in PENALTIES if data.get(k) is not None}
    if "repetition_penalty" not in penalties and "repetition_penalty" in defaults:
        penalties["repetition_penalty"] = defaults["repetition_penalty"]
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                            top_k=top_k, min_p=float(min_p), seed=seed, stop=list(stop), stop_token_ids=list(stop_token_ids),
                            ignore_eos=ignore_eos, logprobs=logprobs, logit_bias=_logit_bias(data, vocab),
                            min_tokens=min_tokens, prompt_logprobs=max(scored) if scored else None, **text_opts,
                            grammar=grammar or tool_grammar, **{k: float(v) for k, v in penalties.items()}).validate()

    stream = data.get("stream", False)
    _type(stream, (bool,), "stream", "a boolean")
    if stream and prompt_logprobs is not None:  # as vLLM
        raise InvalidRequest("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    opts = data.get("stream_options") or {}
    _type(opts, (dict,), "stream_options", "an object")
    include_usage = opts.get("include_usage", False)
    _type(include_usage, (bool,), "stream_options.include_usage", "a boolean")
    continuous = opts.get("continuous_usage_stats", False)
    _type(continuous, (bool,), "stream_options.continuous_usage_stats", "a boolean")

    return_ids = data.get("return_token_ids", False)
    _type(return_ids, (bool,), "return_token_ids", "a boolean")
    route, back = _keyacc_ext(data.get("keyacc"), allow_pinning)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    rid = f"{prefix}-{request_id}" if request_id else f"{prefix}-{uuid.uuid4().hex}"
    inner = f"{rid}-{uuid.uuid4().hex[:8]}" if request_id else rid
    base = params.to_dict()
    reqs = []
    for ids in prompts:
        for j in range(n):
            choice_params = base if j == 0 else {**base, "seed": _child_seed(params.seed, j)}
            # each choice is a request of its own through the graph: its id must be unique
            reqs.append(GenerateRequest(inner if n * len(prompts) == 1 else f"{inner}-{len(reqs)}", list(ids),
                                        choice_params, route, back))
    texts = [x if isinstance(x, str) else tokenizer.decode(x) for x in _prompt_items(data)] if echo else None
    return ParsedRequest(kind, reqs, stream, include_usage, model, return_ids, rid, sum(len(ids) for ids in prompts),
                         [t for t in texts for _ in range(n)] if echo else None, echo_only, include_usage and continuous,
                         prompt_logprobs, n, tool_req)


def _logit_bias(data: dict, vocab: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: token ids (JSON object keys, so strings) -> biases."""
    lb = data.get("logit_bias")
    if not lb:
        return None
    _type(lb, (dict,), "logit_bias", "an object mapping token ids to biases")
    out = {}
    for k, v in lb.items():
        try:
            t = int(k)
        except ValueError:
            raise InvalidRequest(f"logit_bias key {k!r} is not a token id", param="logit_bias") from None
        if not 0 <= t < vocab:
            raise InvalidRequest(f"logit_bias token id {t} is not in [0, {vocab})", param="logit_bias")
        out[t] = float(_type(v, (int, float), "logit_bias", "an object mapping token ids to numbers"))
    return out


def _num_choices(data: dict) -> int:
    """`n` completions per prompt (`best_of` only where it equals n: nothing to pick from)."""
    n = data.get("n")
    n = 1 if n is None else _type(n, (int,), "n", "an integer")
    if n < 1:
        raise InvalidRequest(f"'n' must be at least 1, got {n}", param="n")
    best_of = data.get("best_of")
    if best_of is not None and best_of != n:
        raise InvalidRequest(f"'best_of'={best_of!r} is not supported by this server (only best_of = n)",
                             param="best_of", code="unsupported_parameter")
    return n


def _child_seed(seed: int | None, j: int) -> int | None:
    """The seed of a prompt's j-th choice (vLLM's: seed + j), so that n seeded samples differ
    from each other and each is reproducible."""
    if seed is None:
        return None
    return seed + j if seed + j <= MAX_SEED else seed - j


def _prompt_logprobs(data: dict) -> int | None:
    """vLLM's `prompt_logprobs`: how many alternatives per prompt token (None: not asked for)."""
    k = data.get("prompt_logprobs")
    return None if k is None else _num_alternatives(k, "prompt_logprobs")


def _num_alternatives(k, name: str) -> int:
    """A count of most likely alternatives per token: an integer in [0, MAX_LOGPROBS]."""
    _type(k, (int,), name, "an integer")
    if not 0 <= k <= MAX_LOGPROBS:
        raise InvalidRequest(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", param=name)
    return k


def prompt_logprobs_body(p: ParsedRequest, k: int, entries: list | None, token_text) -> list | None:
    """Choice k's `prompt_logprobs` as vLLM returns them: per prompt token None (the first: nothing
    comes before it) or {token id: {logprob, rank, decoded_token}} for the prompt's own token
    (its rank in the model's distribution) and its p.prompt_logprobs most likely alternatives."""
    if p.prompt_logprobs is None:
        return None
    prompt = p.requests[k].prompt_token_ids
    out: list = []
    for tid, e in zip(prompt, entries or [None] * len(prompt)):
        if e is None:
            out.append(None)
            continue
        d = {str(tid): {"logprob": e[0], "rank": e[2], "decoded_token": token_text(tid)}}
        for r, (j, lj) in enumerate(e[1][:p.prompt_logprobs], 1):
            d.setdefault(str(j), {"logprob": lj, "rank": r, "decoded_token": token_text(j)})
        out.append(d)
    return out


def _logprobs(data: dict, kind: str) -> int | None:
    """How many alternatives per token to return logprobs for (None: no logprobs). Chat:
    `logprobs: true` and `top_logprobs: N`; completions: `logprobs: N`."""
    lp = data.get("logprobs")
    if kind != "chat":
        return None if lp is None or lp is False else _type(lp, (int,), "logprobs", "an integer")
    on = bool(lp is not None and _type(lp, (bool,), "logprobs", "a boolean"))
    top = data.get("top_logprobs")
    if top is None:
        return 0 if on else None
    _num_alternatives(top, "top_logprobs")
    if not on and top > 0:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return top if on else None


def logprobs_body(kind: str, token_ids: list[int], lps: list | None, token_text, text_offset: int = 0):
    """OpenAI's `logprobs` object for these tokens (None where the request asked for none).
    `token_text(id)` is a token's text; chat adds its UTF-8 bytes, completions the offsets."""
    if lps is None:
        return None
    if kind == "chat":
        def entry(i, lp):
            t = token_text(i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        return {"content": [{**entry(i, lp), "top_logprobs": [entry(j, ljp) for j, ljp in top]}
                            for i, (lp, top) in zip(token_ids, lps)]}
    tokens, offsets, off = [], [], text_offset
    for i in token_ids:
        tokens.append(token_text(i))
        offsets.append(off)
        off += len(tokens[-1])
    tops: list = []
    for e in lps:  # keyed by text: of two ids with one text, the likelier one (top is sorted)
        d: dict | None = None if e is None else {}  # None: a prompt's first token (nothing before it)
        for j, ljp in e[1] if e else ():
            d.setdefault(token_text(j), ljp)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": [e and e[0] for e in lps], "top_logprobs": tops,
            "text_offset": offsets}


def as_sent(p: ParsedRequest, k: int, c: TokenChunk, first: bool) -> tuple[str, list[int], list | None, list[int]]:
    """Choice k's chunk `c` as the client gets it: (text, the tokens its logprobs cover, their
    entries or None where none were asked for, the generated token ids). With `echo` the
    choice's first chunk starts with its prompt (the prompt's tokens scored, where logprobs were
    asked for: the first one None, nothing comes before it); `echo_only` drops what was generated."""
    want = p.requests[k].params.get("logprobs") is not None
    text, ids, lps = c.text, list(c.token_ids), (c.logprobs or []) if want else None
    if p.echo_only:
        text, ids, lps = "", [], [] if want else None
    if not (p.echo and first):
        return text, ids, lps, ids
    prompt = p.requests[k].prompt_token_ids
    if lps is not None:  # the prompt's scores, with as many alternatives as `logprobs` asks for
        n = p.requests[k].params["logprobs"]
        lps = [e and (e[0], e[1][:n]) for e in c.prompt_logprobs or [None] * len(prompt)] + lps
    return p.echo[k] + text, list(prompt) + ids, lps, ids


def _completion_prompts(data: dict, tokenizer) -> list[list[int]]:
    """The prompt, or a batch of them (OpenAI: a string, a list of token ids, or a list of
    either), as token ids."""
    if "prompt" not in data:
        raise InvalidRequest("'prompt' is required", param="prompt")
    return [_one_prompt(x, tokenizer) for x in _prompt_items(data)]


def _prompt_items(data: dict) -> list:
    """The completions prompt as a batch: strings and token-id lists."""
    p = data["prompt"]
    if isinstance(p, str) or _token_ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or (x and _token_ids(x)) for x in p):
        return p
    raise InvalidRequest("'prompt' must be a string, a list of token ids, or a non-empty list of either",
                         param="prompt")


def _token_ids(p) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _one_prompt(p, tokenizer) -> list[int]:
    return tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else list(p)


def _chat_prompt(data: dict, tokenizer, tool_list: list[dict] | None = None) -> list[int]:
    msgs = data.get("messages")
    if msgs is None:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        if m["role"] not in ("system", "user", "assistant", "developer", "tool"):
            raise InvalidRequest(f"messages[{i}].role {m['role']!r} is not supported", param=f"messages[{i}].role")
        content = m.get("content")
        if content is None and m["role"] == "assistant":  # OpenAI lets an assistant turn carry no content
            content = ""
        if isinstance(content, list):  # [{"type": "text", "text": ...}], joined by newlines as vLLM does
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                         param=f"messages[{i}].content")
                parts.append(part["text"])
            content = "\n".join(parts)
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content,
                      **({"name": m["name"]} if isinstance(m.get("name"), str) else {}),  # for templates that use it
                      **(tools.check_message(i, m) if m["role"] in ("assistant", "tool") else {})})
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("this model has no chat template; use /v1/completions", param="messages")
    flags = {k: _type(data[k], (bool,), k, "a boolean") if data.get(k) is not None else default
             for k, default in (("add_generation_prompt", True), ("continue_final_message", False),
                                ("add_special_tokens", False))}
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        raise InvalidRequest("'continue_final_message' needs 'add_generation_prompt': false", param="continue_final_message")
    extra = _template_kwargs(data.get("chat_template_kwargs"))
    try:
        text = tokenizer.apply_chat_template(tools.template_messages(clean), tools=tool_list, tokenize=False,
                                             add_generation_prompt=flags["add_generation_prompt"],
                                             continue_final_message=flags["continue_final_message"], **extra)
    except Exception as e:  # noqa: BLE001 - a template's own check (e.g. "roles must alternate", no system role)
        raise InvalidRequest(f"this model's chat template rejected the messages: {e}", param="messages") from None
    return tokenizer(text, add_special_tokens=flags["add_special_tokens"])["input_ids"]


# apply_chat_template's own arguments: never template variables from a request
_RESERVED_TEMPLATE_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                           "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _template_kwargs(kw) -> dict:
    """vLLM's `chat_template_kwargs`: extra variables for the chat template (e.g. Qwen3's
    `enable_thinking`). The template runs in transformers' sandboxed Jinja environment."""
    if kw is None:
        return {}
    _type(kw, (dict,), "chat_template_kwargs", "an object")
    bad = [k for k in kw if not k.isidentifier() or k in _RESERVED_TEMPLATE_ARGS]
    if bad:
        raise InvalidRequest(f"chat_template_kwargs may not set {sorted(bad)}", param="chat_template_kwargs")
    return kw


def _keyacc_ext(ext, allow_pinning: bool) -> tuple[str | None, int | None]:
    if ext is None:
        return None, None
    _type(ext, (dict,), "keyacc", "an object")
    route, back = ext.get("route"), ext.get("migrate_back_after")
    if route is None and back is None:
        return None, None
    if not allow_pinning:
        raise InvalidRequest("route pinning ('keyacc.route') is turned off on this server", param="keyacc.route")
    if route not in ("gpu", "cpu", "stage"):
        raise InvalidRequest("'keyacc.route' must be one of gpu, cpu, stage", param="keyacc.route")
    if back is not None:
        _type(back, (int,), "keyacc.migrate_back_after", "an integer")
        if back < 1:
            raise InvalidRequest("'keyacc.migrate_back_after' must be >= 1", param="keyacc.migrate_back_after")
        if route == "gpu":
            raise InvalidRequest("'keyacc.migrate_back_after' needs route cpu or stage",
                                 param="keyacc.migrate_back_after")
    return route, back


# ---- responses ---------------------------------------------------------------------------
def usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; `cached`: the prompt tokens whose KV came from a prefix cache
    (`prompt_tokens_details.cached_tokens`)."""
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def cached_tokens(p: ParsedRequest, per_choice: list[int]) -> int:
    """A response's cached prompt tokens: each prompt counted once (as its tokens are), the most
    any of its choices found cached (the choices after the first share its prefill)."""
    return sum(max(per_choice[i:i + p.n]) for i in range(0, len(per_choice), p.n))


def choice_body(p: ParsedRequest, index: int, text: str, finish_reason, token_ids: list[int] | None = None,
                logprobs: dict | None = None, *, delta: bool, tool_calls: list[dict] | None = None) -> dict:
    """One choice: of a streamed chunk (`delta`) or of a whole response. `tool_calls`: the calls
    read from the output (a delta's: each with its `index` among the choice's calls)."""
    if p.kind == "chat":
        msg = ({"content": text} if text else {}) if delta else {"role": "assistant", "content": text}
        if tool_calls:
            msg["tool_calls"] = tool_calls
            if not delta and not text:
                msg["content"] = None  # OpenAI's: a message that only calls tools has no content
        elif p.tools is not None and not delta:
            msg["tool_calls"] = []
        choice = {"index": index, "delta" if delta else "message": msg, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if p.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chunk_body(p: ParsedRequest, created: int, text: str, finish_reason, token_ids: list[int] | None = None,
               logprobs: dict | None = None, index: int = 0, tool_calls: list[dict] | None = None) -> dict:
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    return {"id": p.response_id, "object": obj, "created": created, "model": p.model,
            "choices": [choice_body(p, index, text, finish_reason, token_ids, logprobs, delta=True,
                                    tool_calls=tool_calls)]}


_TEXT_MARK = "\x00keyacc-text\x00"
_IDS_MARK = "\x00keyacc-ids\x00"


def sse_text_event(p: ParsedRequest, created: int, index: int):
    """For a stream whose chunks carry nothing but text and, where asked for, their token ids (no
    logprobs, tool calls or usage), a function (text, token ids) -> the SSE event of a mid-stream
    chunk with them: exactly `data: ` + json.dumps(chunk_body(...)) (ASCII-escaped), with only the
    text and the ids encoded per event (the dict and the whole body's encoding cost the ingress
    about a tenth of a token's CPU). The empty chat delta (`{}`, no content) is not one of these:
    None for it."""
    ids = p.return_token_ids
    whole = json.dumps(chunk_body(p, created, _TEXT_MARK, None, [_IDS_MARK] if ids else None, index=index))
    head, rest = whole.split(json.dumps(_TEXT_MARK))
    mid, tail = rest.split(json.dumps([_IDS_MARK])) if ids else (None, rest)
    head, tail = "data: " + head, tail + "\n\n"
    chat = p.kind == "chat"

    def event(text: str, token_ids=()) -> str | None:
        if chat and not text:
            return None
        if ids:
            return head + json.dumps(text) + mid + json.dumps(list(token_ids)) + tail
        return head + json.dumps(text) + tail

    return event


def full_body(p: ParsedRequest, choices: list[dict], n_out: int, traces: list[dict], cached: int = 0) -> dict:
    """The whole response: `choices` from choice_body, in order, and each choice's trace. One
    choice: `keyacc` is its trace; several: every segment is marked with its choice, and each
    choice carries its own trace too."""
    if len(traces) == 1:
        trace = traces[0]
    else:
        for c, t in zip(choices, traces):
            c["keyacc"] = t
        trace = {"segments": [{**s, "choice": i} for i, t in enumerate(traces) for s in t.get("segments", [])],
                 "moves": sum(t.get("moves", 0) for t in traces)}
    return {"id": p.response_id, "object": "chat.completion" if p.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": p.model, "choices": choices,
            "usage": usage(p.num_prompt_tokens, n_out, cached), "keyacc": trace}


# ---- vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) ---------------------
def _check_model(data: dict, served_names: set[str]) -> None:
    """The model is optional here; named, it must be this server's."""
    model = data.get("model")
    if model is not None and model not in served_names:
        raise ModelNotFound(f"the model '{model}' does not exist; this server serves {sorted(served_names)}",
                            param="model", code="model_not_found")


def tokenize(data: dict, *, tokenizer, served_names: set[str], max_model_len: int) -> dict:
    """`prompt` (a string; `add_special_tokens`, default true) or chat `messages` (the chat
    template with the generation prompt, as a chat request is tokenized) -> token ids."""
    _check_model(data, served_names)
    if "messages" in data:
        tool_req = tools.parse_tools({"tools": data.get("tools"), "tool_choice": "none"}, None)
        ids = _chat_prompt(data, tokenizer, tool_req.tools if tool_req else None)
    else:
        prompt = data.get("prompt")
        _type(prompt, (str,), "prompt", "a string")
        special = data.get("add_special_tokens", True)
        _type(special, (bool,), "add_special_tokens", "a boolean")
        ids = tokenizer(prompt, add_special_tokens=special)["input_ids"]
    out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    if data.get("return_token_strs"):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(data: dict, *, tokenizer, served_names: set[str], vocab_size: int) -> dict:
    _check_model(data, served_names)
    ids = data.get("tokens")
    if not _token_ids(ids) or any(t < 0 or t >= vocab_size for t in ids):
        raise InvalidRequest(f"'tokens' must be a list of token ids in [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(ids)}


def tokenizer_info(tokenizer, vocab_size: int) -> dict:
    """What a remote client needs to tokenize as this server does (lm-evaluation-harness's
    remote tokenizer reads eos_token and the chat template)."""
    info = {"tokenizer_class": type(tokenizer).__name__, "vocab_size": vocab_size,
            "chat_template": getattr(tokenizer, "chat_template", None)}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    return info


def generation_defaults(model: str) -> dict:
    """The sampling defaults a model's creator put in its generation_config.json, as vLLM's
    `--generation-config auto` takes them: temperature, top_p, top_k, min_p, repetition_penalty,
    and max_new_tokens as the default max_tokens (here only where a request sends none). They
    fill in what a request leaves out; transformers' generate() applies the same file, so a
    greedy request still gets generate()'s tokens (its repetition penalty included). A value
    this server would refuse in a request is dropped with a warning."""
    import logging

    from transformers import GenerationConfig

    try:
        cfg = GenerationConfig.from_pretrained(model).to_diff_dict()
    except (OSError, ValueError):  # no generation_config.json: neutral defaults
        return {}
    out = {k: cfg[k] for k in SAMPLING_DEFAULTS if cfg.get(k) is not None}
    if isinstance(cfg.get("max_new_tokens"), int) and cfg["max_new_tokens"] > 0:
        out["max_tokens"] = cfg["max_new_tokens"]
    for k in list(out):
        try:
            SamplingParams(**{k: out[k]}).validate()
        except InvalidRequest as e:
            logging.getLogger("ray.serve").warning("generation_config.json: %s ignored (%s)", k, e)
            del out[k]
    return out
