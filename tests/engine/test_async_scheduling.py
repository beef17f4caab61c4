"""Asynchronous scheduling (EngineConfig.async_scheduling, issue #21): in a run of decode steps over
the static buffers, step n+1 is launched from step n's sampled ids (on the device) before they are
read, and step n is postprocessed after. On CPU the steps run eagerly through the same code (the
static-buffer step with `decode_graphs: on`), so what is checked here is the logic: which rows go
ahead, rows that end or leave meanwhile, lazy KV growing, and that every token is the
synchronous engine's and generate()'s."""
import numpy as np
import pytest
import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.decode_graphs import StaticDecode
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from tests.helpers import hf_greedy

PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((14, 3, 9, 20, 6))]


def engine(path, asy=True, **cfg):
    """An engine on the static-buffer decode step."""
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", cpu_kernels="off", decode_graphs="on",
                                 async_scheduling=asy, **{"max_num_seqs": 8, "kv_block_size": 4, **cfg}))
    if asy is not None:
        assert eng.async_scheduling == asy
    return eng


def run(eng, prompts, params, arrivals=None, on_step=None):
    """Step to the end: each request's tokens and finish reason. `arrivals`: step -> [(id, prompt,
    params)] added before that step; `on_step(step, eng)` runs after each step."""
    got, reasons = {}, {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
        got[f"r{i}"] = []
    for step in range(2000):
        for rid, p, sp in (arrivals or {}).get(step, []):
            eng.add_request(rid, p, sp)
            got[rid] = []
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        if on_step is not None:
            on_step(step, eng)
        if not eng.has_unfinished() and step >= max(arrivals or {0: 0}):
            break
    return got, reasons


def test_greedy_rows_leaving_by_length_give_generates_tokens(qwen3_path):
    """Five requests that finish one after another (the batch shrinks through the buckets): most
    steps are launched ahead, every token is generate()'s, every block comes back."""
    eng = engine(qwen3_path)
    max_tokens = [3, 6, 9, 12, 16]
    got, reasons = run(eng, PROMPTS, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens])
    for i, (p, m) in enumerate(zip(PROMPTS, max_tokens)):
        assert got[f"r{i}"] == hf_greedy(qwen3_path, p, m) and reasons[f"r{i}"] == "length"
    assert eng.steps_launched_ahead >= 8  # 15 decode steps in all: all but the first few go ahead
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and eng._ahead is None


def test_rows_that_stop_mid_run_and_sampled_rows_match_the_synchronous_engine(qwen3_path):
    """Rows that end on a stop token id (not foreseeable when the next step is launched: that
    step computes them and drops them) beside seeded sampled rows (top-k, top-p, min-p): the
    same tokens and finish reasons as the synchronous engine."""
    stops = [hf_greedy(qwen3_path, PROMPTS[i], 12)[k] for i, k in ((0, 4), (2, 7))]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stops[0]]),
              SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stops[1]]),
              SamplingParams(max_tokens=18, temperature=1.1, top_p=0.8, min_p=0.05, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=15, temperature=0.7, seed=11, ignore_eos=True)]
    a = engine(qwen3_path)
    got_a = run(a, PROMPTS, params)
    got_s = run(engine(qwen3_path, asy=False), PROMPTS, params)
    assert got_a == got_s
    assert got_a[1]["r0"] == "stop" and got_a[1]["r2"] == "stop" and len(got_a[0]["r0"]) <= 5
    assert a.steps_launched_ahead >= 10 and a.blocks.num_free_blocks == a.blocks.num_blocks


def test_rows_that_read_the_host_run_synchronously(qwen3_path):
    """A batch with a row that wants logprobs or has a penalty is not launched ahead; once those
    rows are done the rest are; the tokens are the synchronous engine's."""
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)]
    a = engine(qwen3_path)
    launched_at = []
    got_a = run(a, PROMPTS[:3], params, on_step=lambda step, e: launched_at.append((len(e.seqs), e._ahead is not None)))
    assert got_a == run(engine(qwen3_path, asy=False), PROMPTS[:3], params)
    assert got_a[0]["r2"] == hf_greedy(qwen3_path, PROMPTS[2], 16)
    assert not any(ahead for n, ahead in launched_at if n > 1)  # never while the host-read rows run
    assert any(ahead for n, ahead in launched_at)  # the plain row alone goes ahead


def test_arrivals_aborts_and_exports_while_a_step_is_in_flight(qwen3_path):
    """Mutations between steps, with a step launched ahead: an arrival waits for the next
    scheduled step (nothing is launched ahead while it waits); an aborted row and an exported one
    are dropped from the step in flight; the export continues elsewhere with generate()'s tokens."""
    eng = engine(qwen3_path)
    other = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", cpu_kernels="off", kv_block_size=4))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (14, 20, 16)]
    events = {}

    def mutate(step, e):
        if e._ahead is None:
            return
        if "abort" not in events and step >= 4:
            events["abort"] = step
            e.abort("r1")
        elif "export" not in events and step >= 7:
            events["export"] = step
            pkg = e.export_request("r0")
            other.import_request(pkg)

    arrivals = {9: [("late", PROMPTS[4], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]}
    got, reasons = run(eng, PROMPTS[:3], params, arrivals=arrivals, on_step=mutate)
    assert set(events) == {"abort", "export"}
    assert "r1" not in reasons and "r0" not in reasons  # neither finished here
    assert got["r2"] == hf_greedy(qwen3_path, PROMPTS[2], 16)
    assert got["late"] == hf_greedy(qwen3_path, PROMPTS[4], 10)
    while other.has_unfinished():  # the exported request, to its end
        for o in other.step():
            got["r0"].extend(o.new_token_ids)
    assert got["r0"] == hf_greedy(qwen3_path, PROMPTS[0], 14)
    assert got["r1"] == hf_greedy(qwen3_path, PROMPTS[1], 20)[:len(got["r1"])]
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_lazy_kv_running_short_preempts_as_the_synchronous_engine_does(qwen3_path):
    """Few KV blocks: the blocks a step launched ahead needs are grown as the scheduler would grow
    them; where they run out nothing is launched and the scheduler preempts; every request still
    gets generate()'s tokens."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(4)]
    eng = engine(qwen3_path, num_kv_blocks=24)
    got, _ = run(eng, PROMPTS[:4], params)
    for i in range(4):
        assert got[f"r{i}"] == hf_greedy(qwen3_path, PROMPTS[i], 24)
    assert eng.scheduler.num_preemptions > 0 and eng.steps_launched_ahead > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_async_scheduling_needs_the_static_decode_step(qwen3_path):
    eng = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", cpu_kernels="off", async_scheduling=True))
    assert not eng.async_scheduling  # (decode_graphs auto: no static buffers on CPU) - synchronous, logged
    with pytest.raises(Exception, match="async_scheduling"):
        EngineConfig(model=qwen3_path, async_scheduling="yes")


def test_by_default_on_where_decode_steps_replay_graphs(qwen3_path, monkeypatch):
    """async_scheduling unset: on where decode steps replay CUDA graphs (vLLM's default), off on
    the static-buffer step run eagerly (CPU); false turns it off there too."""
    from keyacc_ray.engine import runner as runner_mod

    assert EngineConfig(model=qwen3_path).async_scheduling is None
    assert not engine(qwen3_path, asy=None, max_num_seqs=4).async_scheduling  # no graphs on CPU
    monkeypatch.setattr(runner_mod.ModelRunner, "graphs_captured", property(lambda self: [1, 2, 4]))
    eng = engine(qwen3_path, asy=None, max_num_seqs=4)  # as if its steps were graphs
    assert eng.async_scheduling
    params = [SamplingParams(max_tokens=6, temperature=0)] * 2
    assert eng.generate(PROMPTS[:2], params) == [hf_greedy(qwen3_path, p, 6) for p in PROMPTS[:2]]
    assert eng.steps_launched_ahead > 0
    assert not engine(qwen3_path, asy=False, max_num_seqs=4).async_scheduling


def test_staged_buffers_alternate_and_take_token_ids_from_the_previous_step():
    """CUDA's arrangement on CPU (staged=True): two host sets used in turn, copied into the step's
    buffers; with `prev`, each row's token id is gathered from the previous step's ids after the
    copy."""
    seen = []

    def step(ids, pos, blk, off, tables, ctx):
        seen.append((ids.clone(), pos.clone(), ctx.clone()))
        return torch.zeros(len(ids), 3)

    sd = StaticDecode(max_rows=4, width=3, block_size=4, pad_block=9, device=torch.device("cpu"), step=step,
                      staged=True)
    arr = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    first = sd.host_small
    sd.run(sd.fill(np.array([5, 6, 7]), np.array([1, 2, 3]), np.array([0, 1, 2]), arr))
    assert sd.host_small is not first and sd.small is not sd.host_small
    prev = torch.tensor([50, 60, 70])
    b = sd.fill(np.array([2, 0]), np.array([2, 4]), np.array([2, 0]), arr, prev=prev)
    assert sd.host_small is first and b == 2
    sd.run(b)
    ids, pos, ctx = seen[-1]
    assert ids.tolist() == [70, 50] and pos.tolist() == [2, 4] and ctx.tolist() == [3, 5]
    assert seen[0][0].tolist() == [5, 6, 7, 0]  # the first step's own ids, its pad row


def test_the_engine_on_staged_buffers_as_on_cuda(qwen3_path):
    """The engine's static decode step on CUDA's buffer arrangement (two host sets in turn, copied
    into the step's own buffers, each row's token id gathered there from the previous step's ids):
    generate()'s tokens, rows stopping and leaving by length among them."""
    eng = engine(qwen3_path)
    r = eng.runner
    sd = r.static_decode
    r.static_decode = StaticDecode(sd.max_rows, r.max_blocks_per_seq, r.block_size, r.pad_block, r.device,
                                   r._static_step, staged=True)
    stop = hf_greedy(qwen3_path, PROMPTS[3], 12)[5]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (5, 9, 14)]
    params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop]))
    got, reasons = run(eng, PROMPTS[:4], params)
    for i, m in enumerate((5, 9, 14)):
        assert got[f"r{i}"] == hf_greedy(qwen3_path, PROMPTS[i], m)
    want = hf_greedy(qwen3_path, PROMPTS[3], 12)
    assert got["r3"] == want[:want.index(stop) + 1] and reasons["r3"] == "stop"
    assert eng.steps_launched_ahead >= 6 and r.static_decode.small is not r.static_decode.host_small


def test_cached_blocks_taken_while_growing_reach_their_tier_before_the_step_writes_them(qwen3_path, tmp_path):
    """A small block pool with a host tier: decodes launched ahead grow into blocks that held a
    cached prompt, which go to the host tier first (their copy made before the step that writes
    the new keys there); the prompt sent again loads them back and gets generate()'s tokens."""
    # (kv_tier_load "always": the tiny model computes a block about as fast as a copy)
    eng = engine(qwen3_path, num_kv_blocks=16, max_num_seqs=2, kv_host_tier_gb=0.001, kv_tier_load="always")
    head = [(53 * k + 7) % 400 + 5 for k in range(32)]  # 8 blocks
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    run(eng, [head], [p])  # its 8 blocks stay cached
    others = [[(31 * k + 3 * i) % 400 + 5 for k in range(8)] for i in range(2)]
    before = eng.steps_launched_ahead
    run(eng, others, [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 2)  # grow into all 16
    assert eng.steps_launched_ahead > before
    got, _ = run(eng, [head + [99]], [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)])
    t = eng.stats().kv_tiers["tiers"]["host"]
    assert t["loaded_blocks"] >= 6, t
    assert got["r0"] == hf_greedy(qwen3_path, head + [99], 6)


def test_a_full_batch_with_requests_waiting_still_goes_ahead(qwen3_path):
    """At peak load (every slot taken, requests waiting) the same rows run next whatever waits:
    steps go ahead; a slot freed by length admits the next request at once, one freed by a stop
    a step later; every request gets the synchronous engine's tokens and generate()'s."""
    stop = hf_greedy(qwen3_path, PROMPTS[1], 16)[4]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (10, 16, 7, 12, 9)]
    params[1] = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    a = engine(qwen3_path, max_num_seqs=2)
    waiting_ahead = []
    got = run(a, PROMPTS, params, on_step=lambda step, e: waiting_ahead.append(
        e._ahead is not None and e.scheduler.num_waiting > 0))
    assert got == run(engine(qwen3_path, asy=False, max_num_seqs=2), PROMPTS, params)
    for i in (0, 2, 3, 4):
        assert got[0][f"r{i}"] == hf_greedy(qwen3_path, PROMPTS[i], params[i].max_tokens)
    assert got[1]["r1"] == "stop" and any(waiting_ahead)
