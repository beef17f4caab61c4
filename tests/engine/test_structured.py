"""Structured outputs in the engine (no Ray): a grammar's mask in the batched sampler, on both
sampler paths; outputs that validate from a random-weight model (the grammar, not the model,
guarantees them); greedy output equal to transformers' generate() under the same mask; a
hand-off in the middle of a JSON value continues it; bad constraints are 400s naming them."""
import json
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.engine.sampling import Sampler
from keyacc_ray.engine.structured import Grammars, compile_grammar
from keyacc_ray.errors import InvalidRequest
from tests.engine.test_kv_handoff import drain, run_until
from tests.helpers import PROMPTS, hf_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "kind", "flags", "name"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "kind": {"enum": ["cat", "dog", "bird"]},
                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                         "name": {"type": "string", "maxLength": 8}}}


@pytest.fixture(scope="module")
def engine(qwen3_path):
    return LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8, kv_block_size=8))


def text(eng, ids):
    return eng.tokenizer.decode([t for t in ids if t not in eng.eos_ids])


@pytest.mark.parametrize("kind,spec,param,match", [
    ("regex", "(ab", "guided_regex", "unclosed group"),
    ("json", {"type": "frobnicate"}, "response_format", "frobnicate"),
    ("json", "{not json", "guided_json", "cannot be compiled"),
    ("json", [1, 2], "guided_json", "must be a JSON schema"),
    ("choice", [], "guided_choice", "non-empty list"),
    ("choice", ["a", 3], "guided_choice", "non-empty list"),
    ("grammar", "start: foo\n", "guided_grammar", "foo"),
    ("regex", "", "guided_regex", "non-empty"),
])
def test_bad_constraints_are_400s_naming_the_parameter(kind, spec, param, match):
    with pytest.raises(InvalidRequest, match=match) as e:
        compile_grammar(kind, spec, param=param)
    assert e.value.status_code == 400 and e.value.param == param


def test_a_panic_inside_the_grammar_compiler_is_a_400(monkeypatch):
    """llguidance is Rust: on some schemas it panics (pyo3's PanicException, a BaseException that
    `except Exception` misses; the fuzz test met one where it cut an error message inside a
    character). The client gets a 400 naming the parameter; other BaseExceptions go on up."""
    PanicException = type("PanicException", (BaseException,), {})  # (pyo3's own is made at run time)

    def panics(*a, **k):
        raise PanicException("end byte index 100 is not a char boundary")

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", panics)
    with pytest.raises(InvalidRequest, match="cannot be compiled") as e:
        compile_grammar("json", {"type": "object"}, param="guided_json")
    assert e.value.status_code == 400 and e.value.param == "guided_json"
    monkeypatch.setattr(llguidance.LLMatcher, "grammar_from_json_schema", panics)
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        compile_grammar("json", {"type": "object"}, param="response_format")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(llguidance.LLMatcher, "grammar_from_json_schema", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compile_grammar("json", {"type": "object"}, param="guided_json")


def test_a_panic_compiling_a_matcher_in_the_engine_is_a_400(qwen3_path, monkeypatch):
    """The engine compiles each grammar again for its tokenizer: a panic there is the request's
    400 too (the engine thread would otherwise have met a BaseException)."""
    import llguidance as llg

    from transformers import AutoTokenizer

    grammar = compile_grammar("json", {"type": "object"}, param="guided_json")
    PanicException = type("PanicException", (BaseException,), {})

    class Panics:
        def __init__(self, *a, **k):
            raise PanicException("index out of bounds")

    g = Grammars(AutoTokenizer.from_pretrained(qwen3_path), 512, {2})
    monkeypatch.setattr(llg, "LLMatcher", Panics)
    with pytest.raises(InvalidRequest, match="cannot be compiled") as e:
        g.add("r", grammar)
    assert e.value.status_code == 400


def test_mask_allows_exactly_what_the_grammar_allows(qwen3_path, new_sampler):
    """Batched: a constrained row among unconstrained ones gets a token its grammar allows; the
    others get what they get without it (the mask touches only its row)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_path)
    vocab = len(tok)
    g = compile_grammar("choice", ["yes", "no", "maybe"], param="c")
    s = new_sampler()
    s.grammars = Grammars(tok, vocab, {tok.eos_token_id})
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen) * 3
    plain = [SamplingParams(temperature=t, seed=i).validate() for i, t in enumerate((0, 0.8, 0, 1.0))]
    ids = [f"r{i}" for i in range(4)]
    for r, p in zip(ids, plain):
        s.add(r, p)
    want = s.sample(logits, ids, plain, positions=[5] * 4)
    con = [plain[0], plain[1], SamplingParams(temperature=0, grammar=g).validate(),
           SamplingParams(temperature=1.0, seed=3, grammar=g).validate()]
    s.add("g2", con[2])
    s.add("g3", con[3])
    got = s.sample(logits, ids[:2] + ["g2", "g3"], con, lambda i: ([1, 2, 3], 3, {tok.eos_token_id}),
                   positions=[5] * 4)
    assert got[:2] == want[:2]
    firsts = {tok.encode(w)[0] for w in ("yes", "no", "maybe")} | {tok.encode(w[:k])[0] for w in ("yes", "no", "maybe")
                                                                  for k in (1, 2)}
    assert got[2] in firsts and got[3] in firsts, (got, firsts)
    assert got[2] == max(firsts, key=lambda t: logits[2, t].item())  # greedy: the best allowed token
    for r in ids + ["g2", "g3"]:
        s.remove(r)
    assert "g2" not in s.grammars and "g3" not in s.grammars


@pytest.mark.parametrize("any_ws", [False, True])
def test_json_schema_output_validates_from_random_weights(engine, any_ws):
    g = compile_grammar("json", SCHEMA, param="response_format", any_whitespace=any_ws)
    params = [SamplingParams(max_tokens=200, temperature=t, seed=s, grammar=g).validate()
              for t in (0.0, 0.7, 1.0, 1.3) for s in range(3)]
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    for ids in outs:
        assert ids[-1] in engine.eos_ids, "the grammar's end ends the sequence"
        jsonschema.validate(json.loads(text(engine, ids)), SCHEMA)


def test_choice_regex_grammar_and_json_object(engine):
    cases = [(compile_grammar("choice", ["positive", "negative", "neutral ☃"], param="c"),
              lambda s: s in ("positive", "negative", "neutral ☃")),
             (compile_grammar("regex", r"[A-Z][a-z]{2,5} [0-9]{1,3}", param="r"),
              lambda s: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{1,3}", s) is not None),
             (compile_grammar("grammar", 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/\n', param="g"),
              lambda s: re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", s) is not None),
             (compile_grammar("grammar", 'root ::= "x" [0-9] "y"', param="g"),  # GBNF
              lambda s: re.fullmatch(r"x[0-9]y", s) is not None)]
    for g, ok in cases:
        for seed in range(4):
            out = engine.generate([PROMPTS[seed]], SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                                  grammar=g))[0]
            assert ok(text(engine, out)), text(engine, out)
    g = compile_grammar("json_object", None, param="response_format")
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=300, temperature=0, grammar=g))[0]
    if out[-1] in engine.eos_ids:  # any object: a random model may not close it in 300 tokens
        assert isinstance(json.loads(text(engine, out)), dict)


def test_grammar_end_ends_even_with_ignore_eos_and_min_tokens(engine):
    g = compile_grammar("choice", ["ok"], param="c")
    for extra in (dict(ignore_eos=True), dict(min_tokens=10), dict(ignore_eos=True, min_tokens=10)):
        out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0, grammar=g, **extra))[0]
        assert text(engine, out) == "ok" and out[-1] in engine.eos_ids, (extra, out)


class _Mask:
    """transformers' LogitsProcessor over llguidance directly: the reference for greedy output."""

    def __init__(self, tok, grammar, vocab, eos, start):
        lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=sorted(eos))
        self.m, self.vocab, self.start = llguidance.LLMatcher(lt, grammar), vocab, start

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.start:].tolist()
        if out:
            assert self.m.consume_token(out[-1])
        allowed = torch.tensor([bool(b) for b in self.m.compute_logit_bias()][:scores.shape[1]])
        return scores.masked_fill(~allowed[None], float("-inf"))


def test_greedy_equals_transformers_generate_under_the_same_mask(engine, qwen3_path):
    from transformers import LogitsProcessorList

    g = compile_grammar("json", SCHEMA, param="response_format")
    model = hf_model(qwen3_path)[0]
    for prompt in PROMPTS[:3]:
        ids = engine.tokenize(prompt)
        ours = engine.generate([ids], SamplingParams(max_tokens=60, temperature=0, grammar=g))[0]
        proc = _Mask(engine.tokenizer, g, engine.runner.vocab_size, engine.eos_ids, len(ids))
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=60, do_sample=False,
                                 logits_processor=LogitsProcessorList([proc]),
                                 eos_token_id=sorted(engine.eos_ids), pad_token_id=0)[0, len(ids):].tolist()
        assert ours == ref


@pytest.mark.parametrize("k", [1, 4, 9])
def test_hand_off_in_the_middle_of_a_value_continues_it(qwen3_path, k):
    """Export after k tokens (inside the JSON), import into an engine with other blocks: the
    grammar is rebuilt from the output so far; greedy and seeded runs equal the run that
    stayed, and the result validates."""
    g = compile_grammar("json", SCHEMA, param="response_format", any_whitespace=False)
    for params in (SamplingParams(max_tokens=120, temperature=0, grammar=g),
                   SamplingParams(max_tokens=120, temperature=1.0, seed=11, grammar=g)):
        ref = LLMEngine(EngineConfig(model=qwen3_path)).generate([PROMPTS[2]], params)[0]
        a = LLMEngine(EngineConfig(model=qwen3_path))
        b = LLMEngine(EngineConfig(model=qwen3_path, kv_block_size=4))
        a.add_request("s", PROMPTS[2], params)
        first = run_until(a, "s", k)
        b.import_request(a.export_request("s"))
        got = first + drain(b)["s"]
        assert got == ref
        jsonschema.validate(json.loads(text(b, got)), SCHEMA)
        assert "s" not in a.sampler.grammars and "s" not in b.sampler.grammars


def test_matchers_compiled_once_per_grammar_and_independent(engine):
    """Requests with one schema share its compilation (a copy each); their states stay apart."""
    g = compile_grammar("choice", ["alpha", "beta"], param="c")
    gr = engine.sampler.grammars
    gr.add("x1", g)
    gr.add("x2", g)
    assert list(gr._compiled).count(g) == 1
    tok = engine.tokenizer
    a = tok.encode("alpha")
    allowed = gr.allowed([("x1", g, a[:1]), ("x2", g, [])], engine.runner.vocab_size)
    assert allowed[1][tok.encode("alpha")[0]] and allowed[1][tok.encode("beta")[0]]  # x2 is still at the start
    assert allowed[0].tolist() != allowed[1].tolist()  # x1 has moved on: its copy is its own
    gr.remove("x1")
    gr.remove("x2")
