"""The engine's own vLLM histograms: every request queued, prefilled, decoded and finished once
here; a hand-off's parts counted by each engine (prefill where prefilled, decode on both)."""
from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from tests.engine.test_kv_handoff import drain, run_until
from tests.helpers import PROMPTS


def counts(eng):
    return {k.split(":")[1]: sum(h.counts) for k, h in eng.histograms.items()}


def test_engine_histograms(qwen3_path):
    eng = LLMEngine(EngineConfig(model=qwen3_path))
    eng.generate(PROMPTS[:3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    c = counts(eng)
    assert c["request_queue_time_seconds"] == c["request_prefill_time_seconds"] == 3
    assert c["request_decode_time_seconds"] == c["request_inference_time_seconds"] == 3
    assert c["iteration_tokens_total"] >= 6  # one per step
    it = eng.histograms["vllm:iteration_tokens_total"]
    assert it.sum == sum(len(eng.tokenize(p)) for p in PROMPTS[:3]) + 3 * 5  # prompts once, then a row a token
    a, b = LLMEngine(EngineConfig(model=qwen3_path)), LLMEngine(EngineConfig(model=qwen3_path))
    a.add_request("x", PROMPTS[4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    run_until(a, "x", 3)
    b.import_request(a.export_request("x"))
    drain(b)
    ca, cb = counts(a), counts(b)
    assert ca["request_prefill_time_seconds"] == 1 and cb["request_prefill_time_seconds"] == 0
    assert ca["request_decode_time_seconds"] == cb["request_decode_time_seconds"] == 1
    assert cb["request_queue_time_seconds"] == 1
