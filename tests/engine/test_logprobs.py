"""Logprobs: each generated token's log-probability and the top alternatives are transformers'
own (log-softmax of the model's logits at that position), whichever step produced the token
(prefill, batched prefill, decode) and across a KV hand-off between engines."""
import functools

import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from tests.helpers import PROMPTS, hf_model


def hf_logprobs(path: str, prompt: list[int], out: list[int]) -> torch.Tensor:
    model, _ = hf_model(path)
    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # row t predicts out[t]


def check(path, prompt, out, lps, k):
    ref = hf_logprobs(path, prompt, out)
    assert len(lps) == len(out)
    for t, (lp, top) in enumerate(lps):
        assert abs(lp - float(ref[t, out[t]])) < 1e-4
        assert len(top) == k
        want = torch.topk(ref[t], k)
        assert [j for j, _ in top] == want.indices.tolist()
        assert all(abs(a - b) < 1e-4 for (_, a), b in zip(top, want.values.tolist()))


@functools.lru_cache(maxsize=None)
def _engine(path):
    return LLMEngine(EngineConfig(model=path, max_num_seqs=8, dtype="float32"))


def run(eng, prompts, params, rids):
    outs = {r: ([], []) for r in rids}
    for r, p in zip(rids, prompts):
        eng.add_request(r, p, params)
    while any(r in eng.seqs for r in rids):
        for o in eng.step():
            if o.request_id in outs:
                outs[o.request_id][0].extend(o.new_token_ids)
                outs[o.request_id][1].extend(o.logprobs or [])
    return [outs[r] for r in rids]


def test_logprobs_match_transformers_greedy_and_sampled(qwen3_path):
    eng = _engine(qwen3_path)
    prompts = [eng.tokenize(p) for p in PROMPTS[:4]]
    for params, k in ((SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3), 3),
                      (SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, logprobs=0), 0)):
        for p, (out, lps) in zip(prompts, run(eng, prompts, params, [f"a{i}" for i in range(4)])):
            check(qwen3_path, p, out, lps, k)


def test_no_logprobs_unless_asked(qwen3_path):
    eng = _engine(qwen3_path)
    eng.add_request("plain", eng.tokenize(PROMPTS[0]), SamplingParams(max_tokens=3, temperature=0))
    while "plain" in eng.seqs:
        assert all(o.logprobs is None for o in eng.step())


def test_logprobs_across_a_hand_off(qwen3_path):
    a = _engine(qwen3_path)
    b = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8, dtype="float32"))
    prompt = a.tokenize(PROMPTS[3])
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    a.add_request("h", prompt, params)
    out, lps = [], []
    while len(out) < 4:
        for o in a.step():
            out += o.new_token_ids
            lps += o.logprobs
    b.import_request(a.export_request("h"))
    while b.has_unfinished():
        for o in b.step():
            out += o.new_token_ids
            lps += o.logprobs
    check(qwen3_path, prompt, out, lps, 2)
