"""Structured outputs: a request's grammar as a token mask inside the batched sampler (llguidance).

A constraint (a JSON schema, any JSON object, a regular expression, a choice of strings, a Lark or
GBNF grammar) is compiled once, where the request is parsed, into llguidance's grammar text
(`compile_grammar`); a constraint the backend cannot compile is a 400 naming it. The text travels
in `SamplingParams.grammar`, so it goes with the request through every hop and KV package.

Each engine keeps one matcher per constrained request (`Grammars`) and brings it up to date from
the request's own output tokens right before it computes the request's mask: a sequence imported
from another pool, or recomputed after preemption, replays what it has generated so far. The
grammar's state is never carried between pools, only rebuilt, so every device and route applies
the same mask to the same tokens (and greedy output stays the same wherever the request ran).

Plain Python and numpy; the mask is applied to the logits by sampling.py.
"""
from __future__ import annotations

import copy
import json
import logging
from collections import OrderedDict
from typing import NoReturn

import numpy as np

from keyacc_ray.errors import InvalidRequest, is_panic

log = logging.getLogger(__name__)
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON's whitespace between tokens unless a request says otherwise: none, one space, or a line break
# and an indent of up to 20 spaces or tabs: compact JSON, json.dumps' ", " and ": ", and pretty
# printing all fit, and a model cannot spend its max_tokens on whitespace (unbounded whitespace
# lets a weak or random model loop on it; vLLM's disable_any_whitespace is the other cure)
BOUNDED_WHITESPACE = r"[ ]?|\n[ \t]{0,20}"
MAX_GRAMMAR_CHARS = 1 << 20
COMPILED_CACHE = 64  # fresh matchers kept per engine, by grammar text  # a compiled grammar larger than this is refused (the request body is capped too)


def _llg():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise InvalidRequest("structured outputs need the llguidance package, which is not installed",
                             code="unsupported_parameter") from None
    return llguidance


def compile_grammar(kind: str, spec, *, param: str, any_whitespace: bool = True,
                    additional_properties: bool = True, whitespace_pattern: str | None = None) -> str:
    """llguidance grammar text for one constraint, checked (an InvalidRequest naming `param` if
    the backend cannot compile it). `kind`: json (spec: a JSON schema, an object or its text),
    json_object (spec ignored), regex, choice (a list of strings), grammar (Lark or GBNF text).
    `any_whitespace`: JSON may hold whitespace between tokens (BOUNDED_WHITESPACE, or
    `whitespace_pattern`: a regular expression for it) rather than only the compact form; `additional_properties` False closes every object of the schema that says
    nothing about it (vLLM's disable_additional_properties)."""
    llg = _llg()
    opts = {"whitespace_flexible": False}  # (compact: no whitespace at all)
    if whitespace_pattern is not None or any_whitespace:
        opts["whitespace_pattern"] = BOUNDED_WHITESPACE if whitespace_pattern is None else whitespace_pattern
    try:
        if kind == "json":
            schema = json.loads(spec) if isinstance(spec, str) else spec
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(f"'{param}' must be a JSON schema (an object)", param=param)
            if not additional_properties and isinstance(schema, dict):
                schema = copy.deepcopy(schema)
                _close_objects(schema)
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=opts)
        elif kind == "regex":
            if not isinstance(spec, str) or not spec:
                raise InvalidRequest(f"'{param}' must be a non-empty regular expression", param=param)
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            if (not isinstance(spec, list) or not spec
                    or not all(isinstance(c, str) and c for c in spec)):
                raise InvalidRequest(f"'{param}' must be a non-empty list of non-empty strings", param=param)
            grammar = llg.grammar_from("choice", spec)
        elif kind == "grammar":
            if not isinstance(spec, str) or not spec.strip():
                raise InvalidRequest(f"'{param}' must be a grammar (Lark or GBNF text)", param=param)
            grammar = llg.grammar_from("grammar", spec)
        else:
            raise InvalidRequest(f"unknown structured output kind {kind!r}", param=param)
    except InvalidRequest:
        raise
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise InvalidRequest(f"'{param}' cannot be compiled: {e}", param=param, code="invalid_grammar") from None
    except BaseException as e:  # noqa: BLE001 - only llguidance's own panics (below); the rest re-raised
        _raise_if_not_panic(e, param)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"'{param}' compiles to a grammar over {MAX_GRAMMAR_CHARS} characters", param=param,
                             code="invalid_grammar")
    try:
        err = llg.LLMatcher.validate_grammar(grammar, None)
    except BaseException as e:  # noqa: BLE001 - as above
        _raise_if_not_panic(e, param)
    if err:
        raise InvalidRequest(f"'{param}' cannot be compiled: {err.strip()}", param=param, code="invalid_grammar")
    return grammar


def _raise_if_not_panic(e: BaseException, param: str | None, what: str = "") -> NoReturn:
    """A Rust panic inside llguidance on a client's grammar (seen on a schema whose error message
    it cut inside a character) is that input's 400; anything else goes on up."""
    if not is_panic(e):
        raise e
    raise InvalidRequest(f"{what or repr(param)} cannot be compiled (the grammar compiler failed on it)",
                         param=param, code="invalid_grammar") from None


_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_KEYS = ("additionalProperties", "items", "prefixItems", "contains", "not", "if", "then", "else",
             "allOf", "anyOf", "oneOf", "additionalItems", "unevaluatedItems", "propertyNames")


def _close_objects(node) -> None:
    """additionalProperties: false on every object schema (in place) that does not say."""
    if isinstance(node, list):
        for x in node:
            _close_objects(x)
        return
    if not isinstance(node, dict):
        return
    for k in _MAP_KEYS:
        if isinstance(node.get(k), dict):
            for sub in node[k].values():
                _close_objects(sub)
    for k in _SUB_KEYS:
        if isinstance(node.get(k), (dict, list)):
            _close_objects(node[k])
    if "additionalProperties" not in node and isinstance(node.get("properties"), dict):
        node["additionalProperties"] = False


class Grammars:
    """The matchers of one engine's constrained requests, and the masks of a batch's rows.

    `tokenizer`: the model's (a fast tokenizer); `vocab_size`: the logits' width; `eos_ids`: the
    tokens that end a sequence (allowed where the grammar is complete). The llguidance view of the
    tokenizer is made at the first constrained request (about a second for a 150k vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tok = None
        self._live: dict[str, list] = {}  # request id -> [grammar text, matcher, output tokens consumed]
        # grammar text -> a fresh matcher, copied for each request (requests that share a schema pay
        # for its compilation once; the compilation runs on the engine thread, so a new complex
        # schema still costs a step its time)
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def _tokenizer(self):
        if self._tok is None:
            llg = _llg()
            import llguidance.hf

            try:
                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=max(self.vocab_size, len(self._hf)),
                                                         eos_token=self.eos_ids or None)
            except Exception as e:  # noqa: BLE001 - e.g. a slow (Python) tokenizer
                raise InvalidRequest(f"structured outputs are not available for this model's tokenizer: {e}",
                                     code="unsupported_parameter") from None
            log.info("structured outputs: llguidance %s over %d tokens", llg.__version__, self._tok.vocab_size)
        return self._tok

    def _matcher(self, grammar: str):
        m = self._compiled.get(grammar)
        if m is None:
            try:
                m = _llg().LLMatcher(self._tokenizer(), grammar, log_level=0)
            except BaseException as e:  # noqa: BLE001 - llguidance's panics only; the rest re-raised
                _raise_if_not_panic(e, None, "the grammar")
            if m.is_error():
                raise InvalidRequest(f"the grammar cannot be used with this model's tokenizer: {m.get_error()}",
                                     code="invalid_grammar")
            self._compiled[grammar] = m
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return m.deep_copy()

    def add(self, request_id: str, grammar: str) -> None:
        """A constrained request arrives (an InvalidRequest if its grammar does not compile here)."""
        self._live[request_id] = [grammar, self._matcher(grammar), 0]

    def remove(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def _synced(self, request_id: str, grammar: str, output: list[int]):
        """The request's matcher after exactly `output` (replayed from the start where it is behind
        by another history, e.g. after an import)."""
        st = self._live.get(request_id)
        if st is None or st[0] != grammar or st[2] > len(output):
            st = self._live[request_id] = [grammar, self._matcher(grammar), 0]
        _, m, done = st
        if done < len(output):
            if not m.consume_tokens(output[done:]):
                log.warning("request %s: its output left its grammar (%s); only end of sequence is allowed now",
                            request_id, m.get_error())
            st[2] = len(output)
        return m

    def allowed(self, rows: list[tuple[str, str, list[int]]], width: int) -> np.ndarray:
        """[rows, width] bool: the tokens each row may produce next. `rows`: (request id, grammar
        text, its output tokens so far). A matcher that is complete allows only end of sequence;
        one in error (its output left the grammar) the same."""
        words = (max(width, self.vocab_size) + 31) // 32
        bits = np.zeros((len(rows), words), dtype=np.int32)
        for i, (rid, grammar, output) in enumerate(rows):
            m = self._synced(rid, grammar, output)
            row = bits[i]
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        # bit j of word w is token 32 w + j (little-endian words, as llguidance writes them)
        return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :width].astype(bool)
