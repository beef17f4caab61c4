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


def test_logprobs_are_the_models_own_beside_adjusted_rows(qwen3_path):
    """Rows with penalties and a logit bias (their logits adjusted before sampling, in place where
    no row of the batch reads them after) beside rows that ask for logprobs: each logprob is
    still the model's own distribution, and the adjusted rows still draw their adjusted tokens
    (a bias of 100 on one token: every token is it)."""
    eng = _engine(qwen3_path)
    prompts = [eng.tokenize(p) for p in PROMPTS[:4]]
    pen = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.8, presence_penalty=1.0,
                         logprobs=2)
    biased = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={7: 100.0})
    rids = ["lp0", "lp1", "b0", "b1"]
    outs = {r: ([], []) for r in rids}
    for r, p, sp in zip(rids, prompts, (pen, pen, biased, biased)):
        eng.add_request(r, p, sp)
    while any(r in eng.seqs for r in rids):
        for o in eng.step():
            outs[o.request_id][0].extend(o.new_token_ids)
            outs[o.request_id][1].extend(o.logprobs or [])
    for r, p in zip(rids[:2], prompts):
        check(qwen3_path, p, *outs[r], 2)
    assert all(outs[r][0] == [7] * 6 and outs[r][1] == [] for r in rids[2:])
    alone = run(eng, prompts[2:], biased, ["c0", "c1"])  # a batch of biased rows alone (adjusted in place)
    assert [o for o, _ in alone] == [[7] * 6] * 2


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


def first_outputs(eng, prompts, params, rids):
    """Each request's first output (the one that carries its prompt's scores), run to the end."""
    firsts = {}
    for r, p in zip(rids, prompts):
        eng.add_request(r, p, params)
    while any(r in eng.seqs for r in rids):
        for o in eng.step():
            firsts.setdefault(o.request_id, o)
            assert o is firsts[o.request_id] or o.prompt_logprobs is None  # sent once
    return [firsts[r] for r in rids]


def check_prompt(path, prompt, scores, k):
    """scores[t]: prompt[t] given prompt[:t], as transformers scores the whole prompt at once, and
    its rank under that distribution."""
    model, _ = hf_model(path)
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(scores) == len(prompt) and scores[0] is None
    for t in range(1, len(prompt)):
        lp, top, rank = scores[t]
        assert abs(lp - float(ref[t - 1, prompt[t]])) < 1e-4, t
        own = ref[t - 1, prompt[t]]  # its rank, up to ties within float noise
        assert int((ref[t - 1] > own + 1e-4).sum()) + 1 <= rank <= int((ref[t - 1] > own - 1e-4).sum()) + 1, t
        want = torch.topk(ref[t - 1], k)
        assert [j for j, _ in top] == want.indices.tolist()
        assert all(abs(a - b) < 1e-4 for (_, a), b in zip(top, want.values.tolist()))


def test_prompt_logprobs_match_transformers(qwen3_path, monkeypatch):
    """What `echo` with logprobs returns (lm-evaluation-harness's loglikelihood): each prompt
    token's score, with prompts of several lengths prefilled together with plain ones, and in
    chunks of positions when the logits would not fit in one (here 3 positions a chunk)."""
    import keyacc_ray.engine.llm_engine as le

    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8, dtype="float32"))
    prompts = [eng.tokenize(p) for p in PROMPTS[:3]] + [[7], [11, 12]]
    scored = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    rids = [f"s{i}" for i in range(len(prompts))]
    for chunk_rows in (None, 3):
        if chunk_rows:
            monkeypatch.setattr(le, "PROMPT_LOGITS_BYTES", 4 * eng.runner.vocab_size * chunk_rows)
        eng.add_request("plain", prompts[0], plain)  # batched with the scored ones: gets no scores
        outs = first_outputs(eng, prompts, scored, rids)
        for p, o in zip(prompts, outs):
            check_prompt(qwen3_path, p, o.prompt_logprobs, 2)
        while eng.has_unfinished():
            assert all(o.prompt_logprobs is None for o in eng.step())
    # the continuation is unchanged by scoring: same tokens as a plain request
    a, b = run(eng, [prompts[1]], plain, ["x"])[0], run(eng, [prompts[1]], scored, ["y"])[0]
    assert a[0] == b[0]


def test_prompt_logprobs_are_not_sent_again_after_a_hand_off(qwen3_path):
    a = _engine(qwen3_path)
    b = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=8, dtype="float32"))
    prompt = a.tokenize(PROMPTS[2])
    a.add_request("h2", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0))
    outs = []
    while len(outs) < 2:
        outs += a.step()
    check_prompt(qwen3_path, prompt, outs[0].prompt_logprobs, 0)
    b.import_request(a.export_request("h2"))
    while b.has_unfinished():
        assert all(o.prompt_logprobs is None for o in b.step())
