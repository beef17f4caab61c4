"""A request's output constraint, as OpenAI and vLLM spell it, compiled to one grammar (no Ray).

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs`
object (`json`, `regex`, `choice`, `grammar`, `json_object`, `disable_any_whitespace`,
`disable_additional_properties`, `whitespace_pattern`) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (`guided_whitespace_pattern`,
`guided_decoding_backend`). At most one constraint per request; the engine applies it as a token
mask (engine/structured.py)."""
from __future__ import annotations

from keyacc_ray.engine.structured import compile_grammar
from keyacc_ray.errors import InvalidRequest

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = frozenset({"response_format", "structured_outputs", "guided_whitespace_pattern",
                    "guided_decoding_backend", *GUIDED})
# backends a vLLM client may name: every one is served by this server's grammar engine (llguidance)
BACKENDS = {"auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer"}
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback",
               "backend"}


def _bool(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{name}' must be a boolean", param=name)
    return v


def requested(data: dict) -> tuple[str, object, str, dict] | None:
    """(kind, spec, the parameter it came in, options) of the request's constraint, or None."""
    found = []
    rf = data.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise InvalidRequest("'response_format' must be an object with a 'type'", param="response_format")
        if rf["type"] == "json_object":
            found.append(("json_object", None, "response_format", {}))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise InvalidRequest("'response_format.json_schema' must be an object with a 'schema'",
                                     param="response_format.json_schema")
            schema = js.get("schema", {"type": "object"} if "schema" not in js else None)
            if not isinstance(schema, dict):
                raise InvalidRequest("'response_format.json_schema.schema' must be a JSON schema (an object)",
                                     param="response_format.json_schema.schema")
            found.append(("json", schema, "response_format.json_schema.schema", {}))
        elif rf["type"] != "text":
            raise InvalidRequest(f"'response_format.type' {rf['type']!r} is not supported (text, json_object, "
                                 "json_schema)", param="response_format.type", code="unsupported_parameter")
    so = data.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("'structured_outputs' must be an object", param="structured_outputs")
        unknown = sorted(set(so) - set(_SO_KINDS) - _SO_OPTIONS)
        if unknown:
            raise InvalidRequest(f"'structured_outputs' does not support {unknown}", param="structured_outputs",
                                 code="unsupported_parameter")
        opts = {"any_whitespace": not _bool(so.get("disable_any_whitespace", False),
                                            "structured_outputs.disable_any_whitespace"),
                "additional_properties": not _bool(so.get("disable_additional_properties", False),
                                                   "structured_outputs.disable_additional_properties"),
                "whitespace_pattern": _pattern(so.get("whitespace_pattern"), "structured_outputs.whitespace_pattern")}
        for kind in _SO_KINDS:
            v = so.get(kind)
            if v is None or (kind == "json_object" and v is False):
                continue
            if kind == "json_object":
                _bool(v, "structured_outputs.json_object")
            found.append((kind, v, f"structured_outputs.{kind}", opts))
    ws = _pattern(data.get("guided_whitespace_pattern"), "guided_whitespace_pattern")
    backend = data.get("guided_decoding_backend")
    if backend is not None and (not isinstance(backend, str) or backend.split(":")[0] not in BACKENDS):
        raise InvalidRequest(f"'guided_decoding_backend' must be one of {sorted(BACKENDS)}",
                             param="guided_decoding_backend")
    for name, kind in GUIDED.items():
        if data.get(name) is not None:
            found.append((kind, data[name], name, {"whitespace_pattern": ws}))
    if len(found) > 1:
        raise InvalidRequest(f"only one output constraint per request; got {[f[2] for f in found]}",
                             param=found[1][2])
    return found[0] if found else None


def _pattern(v, name: str) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise InvalidRequest(f"'{name}' must be a regular expression", param=name)
    return v


def grammar_of(data: dict) -> str | None:
    """The request's constraint compiled (None: unconstrained); a 400 naming what does not compile."""
    got = requested(data)
    if got is None:
        return None
    kind, spec, param, opts = got
    return compile_grammar(kind, spec, param=param, **{k: v for k, v in opts.items() if v is not None})
