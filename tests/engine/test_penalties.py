"""Presence / frequency (OpenAI) and repetition (transformers, vLLM) penalties and OpenAI's
logit_bias: the same tokens as transformers' generate() with the same logits processing, also
across a KV hand-off."""
import pickle
import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.engine.penalties import process_logits
from keyacc_ray.errors import InvalidRequest
from tests.engine.test_kv_handoff import drain, run_until
from tests.helpers import PROMPTS, hf_greedy, hf_model

N_NEW = 24


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented formula over the generated tokens: logit -= frequency * count + presence."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len:]
        if out.numel():
            ids, counts = out.unique(return_counts=True)
            scores[0, ids] -= self.frequency * counts.to(scores.dtype) + self.presence
        return scores


def hf_penalized(path, prompt_ids, n, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    model, tok = hf_model(path)
    ids = torch.tensor([prompt_ids])
    procs = LogitsProcessorList([OpenAIPenalties(len(prompt_ids), presence, frequency)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id,
                             repetition_penalty=repetition, logits_processor=procs,
                             sequence_bias={(t,): float(b) for t, b in bias.items()} if bias else None)
    return out[0, ids.shape[1]:].tolist()


def test_penalize_matches_transformers_and_openai_formula():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(50, generator=g) * 3
    history, n_prompt = [3, 7, 7, 9, 1, 7, 3, 40], 4  # output: 1, 7, 3, 40
    rep = process_logits(row, history, n_prompt, SamplingParams(repetition_penalty=1.7))
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]), row[None].clone())[0]
    assert torch.equal(rep, want)
    pf = process_logits(row, history, n_prompt, SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25))
    want = row.clone()
    for t, c in {1: 1, 7: 1, 3: 1, 40: 1}.items():
        want[t] -= -0.25 * c + 0.5
    assert torch.allclose(pf, want) and pf[9] == row[9]  # 9 only in the prompt: no presence penalty
    assert torch.equal(process_logits(row, history, n_prompt, SamplingParams()), row)
    biased = process_logits(row, history, n_prompt, SamplingParams(logit_bias={4: 100.0, 9: -2.5}))
    assert biased[4] == row[4] + 100 and biased[9] == row[9] - 2.5 and torch.equal(biased[10:], row[10:])
    # the bias first, then the penalties (vLLM's and transformers' order): a biased token that is
    # in the history has its biased logit penalized
    both = process_logits(row, history, n_prompt, SamplingParams(logit_bias={7: 2.0, 40: -3.0}, repetition_penalty=1.7,
                                                                 frequency_penalty=0.5))
    for t, b, count in ((7, 2.0, 1), (40, -3.0, 1)):
        x = row[t] + b
        assert torch.isclose(both[t], (x / 1.7 if x > 0 else x * 1.7) - 0.5 * count)


@pytest.mark.parametrize("kw", [{"repetition_penalty": 0}, {"repetition_penalty": 2.5}, {"presence_penalty": 3},
                                {"frequency_penalty": -2.1}, {"frequency_penalty": float("nan")},
                                {"presence_penalty": True}, {"logit_bias": {5: 101}}, {"logit_bias": {-1: 1}},
                                {"logit_bias": {i: 1 for i in range(2000)}}])
def test_penalty_ranges(kw):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == next(iter(kw))


@pytest.mark.parametrize("pen", [dict(repetition=1.5), dict(presence=1.0, frequency=0.5),
                                 dict(presence=0.3, frequency=1.2, repetition=1.3), dict(bias={40: 8.0, 41: -100}),
                                 dict(presence=0.5, frequency=0.7, repetition=1.2, bias={40: 3.0})])
def test_greedy_with_penalties_equals_generate_across_a_handoff(qwen3_path, pen):
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True,
                            presence_penalty=pen.get("presence", 0.0), frequency_penalty=pen.get("frequency", 0.0),
                            repetition_penalty=pen.get("repetition", 1.0), logit_bias=pen.get("bias"))
    src = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4))
    dst = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, kv_block_size=4))
    prompts = {f"p{i}": src.tokenize(PROMPTS[i]) for i in (1, 6, 8)}
    for rid, ids in prompts.items():
        src.add_request(rid, ids, params)
    outs = {}
    first = run_until(src, "p6", 9, outs)
    dst.import_request(pickle.loads(pickle.dumps(src.export_request("p6"))))
    rest = drain(dst)["p6"]
    drain(src, outs)
    for rid, ids in prompts.items():
        want = hf_penalized(qwen3_path, ids, N_NEW, **pen)
        got = first + rest if rid == "p6" else outs[rid]
        assert got == want, rid
    # the penalties changed something: the test would catch them being ignored
    assert any(hf_penalized(qwen3_path, ids, N_NEW, **pen) != hf_greedy(qwen3_path, ids, N_NEW)
               for ids in prompts.values())


def test_min_tokens_rules_out_the_end_until_reached():
    row = torch.zeros(20)
    p = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[5])
    early = process_logits(row, [1, 2, 9], 2, p, eos_ids={7})  # one output token so far
    assert early[5] == early[7] == float("-inf") and early[9] == 0
    assert torch.equal(process_logits(row, [1, 2, 9, 9, 9], 2, p, eos_ids={7}), row)  # three: free again
    no_eos = process_logits(row, [1, 2], 2, SamplingParams(max_tokens=10, min_tokens=3, ignore_eos=True), eos_ids={7})
    assert no_eos[7] == 0  # eos does not end this request: nothing to rule out
    with pytest.raises(InvalidRequest):
        SamplingParams(max_tokens=4, min_tokens=5).validate()


def test_min_tokens_equals_generate_min_new_tokens(qwen3_path):
    """With the end-of-sequence token made likely (a bias), the output runs min_tokens long and then
    ends, exactly as generate(min_new_tokens=...) with the same bias."""
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2))
    model, tok = hf_model(qwen3_path)
    eos = tok.eos_token_id
    ids = eng.tokenize(PROMPTS[4])
    eng.add_request("r", ids, SamplingParams(max_tokens=12, temperature=0, min_tokens=5, logit_bias={eos: 30.0}))
    got = drain(eng)["r"]
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=12, min_new_tokens=5, do_sample=False,
                             eos_token_id=eos, pad_token_id=tok.pad_token_id, sequence_bias={(eos,): 30.0})
    want = out[0, len(ids):].tolist()
    assert got == want and len(got) == 6 and got[-1] == eos


def test_min_p_keeps_only_tokens_near_the_most_likely(new_sampler):
    """min_p: a sampled token is never less likely than min_p x the most likely one (after
    temperature), whatever the seed; min_p 1 leaves only the most likely token."""
    from keyacc_ray.engine.sampling import Sampler

    logits = torch.tensor([[2.0, 1.9, 1.0, 0.5, 0.0, -1.0, 1.5, 1.95]])
    probs = torch.softmax(logits[0], dim=-1)
    allowed = set(torch.nonzero(probs >= 0.8 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < logits.shape[1]
    s, drawn = new_sampler(), set()
    for seed in range(200):
        p = SamplingParams(temperature=1.0, min_p=0.8, seed=seed).validate()
        s.add(f"r{seed}", p)
        drawn.add(s.sample(logits, [f"r{seed}"], [p])[0])
    assert drawn == allowed  # every allowed token comes up in 200 draws, nothing else ever does
    p = SamplingParams(temperature=1.0, min_p=1.0, seed=3).validate()
    s.add("one", p)
    assert s.sample(logits, ["one"], [p]) == [0]
    with pytest.raises(InvalidRequest):
        SamplingParams(min_p=1.5).validate()


def test_top_k_draws_only_among_the_k_best_and_reproduces(new_sampler):
    """top-k sampling works on the candidates alone: every draw is one of the k best tokens (ties
    with the k-th kept), each of them comes up, and a seed draws the same token again."""
    from keyacc_ray.engine.sampling import Sampler

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 5000, generator=g)
    logits[0, 17] = logits[0, 4000] = logits.max() + 1.0  # a tie at the top
    best = set(torch.topk(logits[0], 3).indices.tolist())
    s, drawn = new_sampler(), []
    for seed in range(300):
        p = SamplingParams(temperature=2.0, top_k=3, top_p=0.99, seed=seed).validate()
        s.add(f"r{seed}", p)
        drawn.append(s.sample(logits, [f"r{seed}"], [p])[0])
    assert set(drawn) == best and {17, 4000} <= best
    p = SamplingParams(temperature=2.0, top_k=3, top_p=0.99, seed=5).validate()
    s.add("again", p)
    assert s.sample(logits, ["again"], [p])[0] == drawn[5]


@pytest.mark.parametrize("kw", [{}, {"top_k": 4}, {"top_p": 0.9}, {"min_p": 0.1}])
def test_sampled_frequencies_follow_the_distribution(kw, new_sampler):
    """The inverse-CDF draw: over 4000 seeds each token comes up as often as its probability
    after temperature / top-k / top-p / min-p says (within 0.03), and never a token they rule out."""
    from keyacc_ray.engine.sampling import Sampler

    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -3.0]])
    p0 = SamplingParams(temperature=0.8, **kw).validate()
    probs = torch.softmax(logits[0] / 0.8, dim=-1)
    if "top_k" in kw:
        probs[probs < torch.topk(probs, kw["top_k"]).values[-1]] = 0
    if "min_p" in kw:
        probs[probs < kw["min_p"] * probs.max()] = 0
    if "top_p" in kw:
        probs = probs / probs.sum()
        order = torch.argsort(probs, descending=True)
        keep = torch.cumsum(probs[order], 0) - probs[order] < kw["top_p"]
        probs[order[~keep]] = 0
    probs = probs / probs.sum()
    s, counts = new_sampler(), torch.zeros(6)
    for seed in range(4000):
        p = SamplingParams(**{**p0.to_dict(), "seed": seed})
        s.add("r", p)
        counts[s.sample(logits, ["r"], [p])[0]] += 1
    assert torch.all(counts[probs == 0] == 0)
    assert torch.allclose(counts / 4000, probs, atol=0.03), (counts / 4000, probs)


def test_history_follows_a_growing_history():
    """What the penalties read, kept up to date step by step: the distinct ids of prompt and output
    and the output's counts equal the history's at every step (and start again for a history
    that is not the one they followed)."""
    from collections import Counter

    from keyacc_ray.engine.penalties import History

    p = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)
    h, hist = History(), [5, 3, 5]
    for t in [3, 9, 9, 1, 5, 2] + list(range(40)):  # (past the arrays' first room)
        hist.append(t)
        h.update(hist, 3, p)
        assert sorted(h.seen.ids[:h.seen.n].tolist()) == sorted(set(hist))
        assert dict(zip(h.out.ids[:h.out.n].tolist(), h.out.counts[:h.out.n].tolist())) == Counter(hist[3:])
    h.update([7, 7], 1, p)  # shorter: another history
    assert h.seen.ids[:h.seen.n].tolist() == [7] and h.out.counts[:h.out.n].tolist() == [1.0]
    h2 = History()
    h2.update([1], 0, SamplingParams(repetition_penalty=1.1))
    assert h2.seen.n == 1 and h2.out is None  # only what the parameters use is kept
    h.update([], 0, p)  # another history, empty so far: then it grows from nothing
    h.update([4, 6, 4, 2], 0, p)
    assert sorted(h.seen.ids[:h.seen.n].tolist()) == [2, 4, 6] and h.out.counts[:h.out.n].tolist() == [2.0, 1.0, 1.0]


def test_a_batch_of_adjusted_rows_equals_each_row_alone():
    """Rows with different penalties, biases and min_tokens (and rows without any) adjusted in one
    call come out bitwise as each row adjusted alone; rows left out are untouched."""
    from keyacc_ray.engine.penalties import History, apply

    g = torch.Generator().manual_seed(1)
    V = 300
    logits = torch.randn(6, V, generator=g) * 4
    hists = [[1, 2, 3, 2, 2, 50], [7, 7, 7], [299, 0, 1, 0], [4, 5, 6, 7, 8, 9, 4], [10], [3, 3, 3, 3]]
    nps = [2, 3, 1, 4, 1, 2]
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
              SamplingParams(repetition_penalty=0.8, logit_bias={7: 5.0, 299: -3.0}),
              SamplingParams(frequency_penalty=-0.7, min_tokens=5, stop_token_ids=[9]),
              SamplingParams(repetition_penalty=1.3, logit_bias={4: 1.5}, presence_penalty=1.0),
              SamplingParams(),
              SamplingParams(repetition_penalty=1.05, min_tokens=1, ignore_eos=True)]
    rows = [0, 1, 2, 3, 5]  # row 4 asks for nothing: not passed
    got = logits.clone()
    hs = []
    for r in rows:
        h = History()
        h.update(hists[r], nps[r], params[r])
        hs.append(h)
    apply(got, rows, [params[r] for r in rows], hs, eos_ids={8})
    for r in rows:
        assert torch.equal(got[r], process_logits(logits[r], hists[r], nps[r], params[r], eos_ids={8})), r
    assert torch.equal(got[4], logits[4])
    assert got[2, 9] == got[2, 8] == float("-inf") and torch.isfinite(got[5]).all()  # min_tokens; ignore_eos
    assert not torch.equal(got[0], logits[0])


@pytest.mark.parametrize("use_kernels", [False, True])
def test_kept_adjustments_follow_growing_histories_as_fresh_ones_do(use_kernels):
    """A batch's Adjustments kept step after step (its flat indices appended to as the histories
    grow: none, one or several new ids a row, a row's history started again, the vocabulary
    changed) adjust the logits bitwise as adjustments made afresh at every step do (those in
    torch's index operations; the kept ones also through the CPU kernels' penalize_at and
    subtract_at, negative logits, zeros and infinities among them)."""
    from keyacc_ray import kernels
    from keyacc_ray.engine.penalties import Adjustments, History, apply

    K = kernels.load() if use_kernels else None
    assert K is not None or not use_kernels, kernels.unavailable_reason()

    g = torch.Generator().manual_seed(2)
    rng = random.Random(2)
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.4),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(presence_penalty=-0.7),
              SamplingParams(repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.1),
              SamplingParams(presence_penalty=1.5, repetition_penalty=1.1)]
    rows = [0, 2, 3, 5, 6]
    hists = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in params]
    nps = [len(h) for h in hists]
    hs = [History() for _ in params]
    kept = Adjustments(rows, params, eos_ids=())
    V = 64
    for step in range(40):
        if step == 25:
            V = 80  # another vocabulary (a kept index for the old one would be wrong)
        for k, h in enumerate(hists):
            grow = rng.choice([0, 1, 1, 1, 3]) if step != 12 else 200  # (past the first room)
            h.extend(rng.randrange(V) for _ in range(grow))
        if step == 30:  # row 1 is another request now (a history that is not the one followed)
            hists[1], nps[1] = [1, 2, 3], 2
        for k, h in enumerate(hs):
            h.update(hists[k], nps[k], params[k])
        logits = torch.randn(8, V, generator=g) * 3
        logits[:, :3] = torch.tensor([0.0, -0.0, float("-inf")])
        got, want = logits.clone(), logits.clone()
        kept.apply(got, hs, K)
        fresh = [History() for _ in params]
        for k, h in enumerate(fresh):
            h.update(hists[k], nps[k], params[k])
        apply(want, rows, params, fresh, eos_ids=())
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), step
        assert not torch.equal(got, logits)


def test_sampled_rows_with_penalties_draw_in_a_batch_what_they_draw_alone(new_sampler):
    """Through the sampler: a batch of penalized, biased and plain rows, sampled and greedy, draws
    per row what the row draws alone, step after step as the histories grow."""
    g = torch.Generator().manual_seed(5)
    kws = [dict(repetition_penalty=1.4, temperature=0.9, top_k=30), dict(presence_penalty=1.5, temperature=0.0),
           dict(temperature=0.8), dict(frequency_penalty=0.9, logit_bias={3: 4.0}, temperature=1.0, top_p=0.9),
           # the end ruled out for 3 steps of the kept batch, then likely (the batch's adjustments are
           # made once; which rows min_tokens still holds is read every step)
           dict(temperature=0.8, min_tokens=5, logit_bias={0: 12.0}),
           dict(repetition_penalty=1.4, temperature=0.0)]
    params = [SamplingParams(seed=i, **kw).validate() for i, kw in enumerate(kws)]
    batch_s, alone_s = new_sampler(), new_sampler()
    hist = [[int(x) for x in torch.randint(0, 200, (6,), generator=g)] for _ in params]
    rids = [f"r{i}" for i in range(len(params))]
    for r, p in zip(rids, params):
        batch_s.add(r, p)
        alone_s.add(r, p)
    for _ in range(12):
        logits = torch.randn(len(params), 200, generator=g) * 2
        pos = [len(h) for h in hist]
        batch = batch_s.sample(logits, rids, params, lambda i: (hist[i], 4, {0}), positions=pos)
        alone = [alone_s.sample(logits[i:i + 1], [rids[i]], [params[i]], lambda _, i=i: (hist[i], 4, {0}),
                                positions=[pos[i]])[0] for i in range(len(params))]
        assert batch == alone
        for h, t in zip(hist, batch):
            h.append(t)
    assert 0 not in hist[4][6:9] and 0 in hist[4][9:]
    batch_s.remove("r0")
    assert "r0" not in batch_s._history


def test_a_batch_of_mixed_filters_draws_what_each_row_draws_alone(new_sampler):
    """The batched sampler: rows with top-k, top-p, min-p, several at once, none, and greedy, in one
    call, draw the same tokens as each row sampled alone; the draw is keyed by (seed, position)."""
    from keyacc_ray.engine.sampling import Sampler, uniforms

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 3000, generator=g) * 3
    kws = [dict(top_k=5), dict(top_p=0.9), dict(min_p=0.05), dict(top_k=40, top_p=0.8, min_p=0.01), {},
           dict(temperature=0.0), dict(top_p=0.999999)]  # the last widens past 256 candidates
    params = [SamplingParams(**{"temperature": 0.7, "seed": 11 + i, **kw}).validate() for i, kw in enumerate(kws)]
    s = new_sampler()
    for i, p in enumerate(params):
        s.add(f"r{i}", p)
    positions = [40 + i for i in range(7)]
    batch = s.sample(logits, [f"r{i}" for i in range(7)], params, positions=positions)
    alone = [s.sample(logits[i:i + 1], [f"r{i}"], [params[i]], positions=[positions[i]])[0] for i in range(7)]
    assert batch == alone and batch[5] == int(logits[5].argmax())
    again = s.sample(logits, [f"r{i}" for i in range(7)], params, positions=[p + 1 for p in positions])
    assert again != batch  # the next position draws again
    assert uniforms([11], [40]) == uniforms([11], [40]) and uniforms([11], [40]) != uniforms([12], [40])
    seeds, pos = [2**63 + 7 * i for i in range(40)], [3 * i for i in range(40)]  # the numpy and the few-rows paths
    assert uniforms(seeds, pos).tolist() == [uniforms([a], [b])[0] for a, b in zip(seeds, pos)]
    assert s.state("r0").tolist() == [11]  # all a KV package carries of the sampler


def test_a_seeded_request_draws_the_same_tokens_after_recomputation(qwen3_path):
    """Preempted (lazy KV, recomputed later) or not, a seeded sampled request gets the same tokens:
    draws are keyed by position, not by a generator's state."""
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine

    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=21, ignore_eos=True)
    ref = LLMEngine(EngineConfig(model=qwen3_path)).generate([list(range(3, 23))], params)[0]
    tight = LLMEngine(EngineConfig(model=qwen3_path, kv_block_size=4, num_kv_blocks=14, max_num_seqs=4))
    outs = tight.generate([list(range(3, 23))] + [list(range(50, 60))] * 2, params)
    assert tight.scheduler.num_preemptions > 0
    assert outs[0] == ref
