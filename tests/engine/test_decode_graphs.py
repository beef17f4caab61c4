"""The GPU decode step's parts, checked on CPU (issue #21): the fixed-size decode step over static
buffers (engine/decode_graphs.py: buckets, padding, the pad block; on CUDA the same step is captured
as CUDA graphs) and the Triton paged decode-attention kernel (engine/triton_attention.py), run here
through Triton's interpreter. Tokens are generate()'s through every one of them."""
import numpy as np
import pytest
import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine import triton_attention
from keyacc_ray.engine.decode_graphs import StaticDecode, bucket_sizes
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.paged_attention import reference_decode
from keyacc_ray.engine.request import SamplingParams
from tests.engine.test_fast_path import _random_model
from tests.helpers import hf_greedy


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(2) == [1, 2]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert bucket_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_fill_pads_to_the_bucket_and_the_step_reads_the_buffers():
    seen = []

    def step(ids, pos, blk, off, tables, ctx):
        b = len(ids)
        seen.append((b, ids.clone(), pos.clone(), blk.clone(), off.clone(), tables.clone(), ctx.clone()))
        return torch.arange(b * 3, dtype=torch.float32).view(b, 3)

    sd = StaticDecode(max_rows=8, width=6, block_size=4, pad_block=99, device=torch.device("cpu"), step=step)
    arr = np.arange(10 * 6, dtype=np.int32).reshape(10, 6)  # the block manager's array: row r, column c
    rows = np.array([7, 2, 5])
    pos = np.array([9, 0, 17])  # blocks 2, 0 and 4 of those rows
    b = sd.fill(np.array([11, 12, 13]), pos, rows, arr)
    assert b == 4 and sd.bucket(5) == 8 and sd.bucket(9) is None
    sd.run(b)
    got_b, ids, p, blk, off, tables, ctx = seen[-1]
    assert got_b == 4
    assert ids.tolist() == [11, 12, 13, 0] and p.tolist() == [9, 0, 17, 0]
    assert blk.tolist() == [arr[7, 2], arr[2, 0], arr[5, 4], 99]  # the pad row writes into the pad block
    assert off.tolist() == [1, 0, 1, 0] and ctx.tolist() == [10, 1, 18, 1]
    assert tables.shape == (4, 6)
    assert tables[:3, :5].tolist() == arr[rows, :5].tolist() and tables[3, 0] == 99
    # a smaller step afterwards: the rows it no longer has are padding again
    b = sd.fill(np.array([4]), np.array([3]), np.array([1]), arr)
    sd.run(b)
    got_b, ids, p, blk, off, tables, ctx = seen[-1]
    assert got_b == 1 and ids.tolist() == [4] and blk.tolist() == [arr[1, 0]] and ctx.tolist() == [4]
    b = sd.fill(np.array([4, 5]), np.array([3, 3]), np.array([1, 1]), arr)
    sd.run(b)
    assert seen[-1][0] == 2 and seen[-1][6].tolist() == [4, 4]
    assert not sd.capture()  # no graphs on CPU: the eager step over the same buffers


def _generate_with_buckets(path, prompts, max_tokens, **cfg):
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", max_num_seqs=8, cpu_kernels="off",
                                 decode_graphs="on", **cfg))
    sd = eng.runner.static_decode
    assert sd is not None and eng.runner.decodes_arrays
    buckets = []
    real = sd.run
    sd.run = lambda b: buckets.append(b) or real(b)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    return eng, eng.generate(prompts, params), buckets


@pytest.mark.parametrize("cls,kw", [("Qwen3Config", {"head_dim": 16}),
                                    ("Qwen3Config", {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"],
                                                     "sliding_window": 8, "use_sliding_window": True}),
                                    ("LlamaConfig", {"num_key_value_heads": 1})])
def test_static_decode_steps_give_generates_tokens(tmp_path, cls, kw):
    """Five requests that finish one after another: decode steps at buckets 8, 4, 2 and 1 with
    padding rows, every row generate()'s tokens; the pad block is never one the engine hands out."""
    path = _random_model(tmp_path, cls, **kw)
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((14, 3, 9, 20, 6))]
    max_tokens = [3, 6, 9, 12, 16]
    eng, outs, buckets = _generate_with_buckets(path, prompts, max_tokens, kv_block_size=4, max_prefill_tokens=64)
    for p, m, out in zip(prompts, max_tokens, outs):
        assert out == hf_greedy(path, p, m)
    assert {8, 4, 2, 1} <= set(buckets)
    r = eng.runner
    assert r.pad_block == r.num_blocks == eng.blocks.num_blocks and r.cache.k[0].shape[0] == r.num_blocks + 1
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # all returned, none was the pad block


def test_prompts_held_while_decoding_still_give_generates_tokens(qwen3_path):
    """prefill_delay_factor (1.0 by default where decode steps replay CUDA graphs; 0 on CPU): prompts
    that arrive while others decode wait for one another, and every request still gets generate()'s
    tokens."""
    assert LLMEngine(EngineConfig(model=qwen3_path, cpu_kernels="off")).prefill_delay_factor == 0.0
    eng = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", max_num_seqs=8, cpu_kernels="off",
                                 decode_graphs="on", prefill_delay_factor=50.0))
    prompts = [list(range(3 + i, 10 + 2 * i)) for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    admitted_at = {}
    for step in range(200):
        if step < len(prompts):  # one arrival a step while the first ones decode
            eng.add_request(f"r{step}", prompts[step], params)
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            admitted_at.setdefault(o.request_id, step)
        if step >= len(prompts) and not eng.has_unfinished():
            break
    assert eng.scheduler.num_held > 0
    assert len(set(admitted_at.values())) < len(prompts)  # later arrivals prefilled together
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(qwen3_path, p, 10)


def test_decode_graphs_off_and_auto_on_cpu(qwen3_path):
    for mode in ("off", "auto"):
        eng = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", cpu_kernels="off", decode_graphs=mode))
        assert eng.runner.static_decode is None and eng.runner.graphs_captured == []
    with pytest.raises(Exception, match="decode_graphs"):
        EngineConfig(model=qwen3_path, decode_graphs="yes")
    for bad in (-1, "1", True):
        with pytest.raises(Exception, match="prefill_delay_factor"):
            EngineConfig(model=qwen3_path, prefill_delay_factor=bad)


# ---- the Triton kernel, through Triton's interpreter on CPU ------------------------------------------
triton = pytest.importorskip("triton")


@pytest.fixture
def interpret():
    """Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET before Triton is imported)."""
    assert triton_attention.available(torch.device("cpu")), triton_attention.unavailable_reason()


@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window", [
    (4, 2, 64, 16, 0), (6, 2, 40, 8, 0), (8, 8, 32, 16, 5), (14, 2, 64, 32, 0), (4, 1, 16, 4, 7)])
def test_triton_paged_decode_matches_the_reference(interpret, dtype, heads, kv_heads, dim, block_size, window,
                                                   splits):
    """GQA groups of 1-7 heads, head sizes that are not powers of two, several block sizes, windows,
    rows of mixed lengths through shuffled block tables wider than any row; each (row, KV head)'s
    keys in one program, or split over 3 or 16 and combined (flash-decoding: more splits than a
    short row has tiles, so some have nothing to do)."""
    g = torch.Generator().manual_seed(heads * 100 + dim)
    nb, width = 40, 12
    kp = torch.randn((nb, kv_heads, block_size, dim), generator=g).to(dtype)
    vp = torch.randn((nb, kv_heads, block_size, dim), generator=g).to(dtype)
    qd = torch.randn((5, heads, 1, dim), generator=g).to(dtype)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in range(5)]).to(torch.int32)
    ctx = torch.tensor([1, 17, min(150, width * block_size), 3, block_size * 6])
    got = triton_attention.paged_decode(qd, kp, vp, tables, ctx, window, dim ** -0.5, splits)
    ref = reference_decode(qd.float(), kp.float(), vp.float(), tables.long(), ctx, window, dim ** -0.5)
    assert got.shape == ref.shape and got.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 3e-3
    assert float((got.float() - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max()))


def test_decode_splits_fill_the_device_and_stop_once_the_batch_does():
    """Eight programs per multiprocessor (the interpreter counts as 8: 64 programs): a power of
    two, at most MAX_SPLITS, 1 once rows x KV heads alone reach that."""
    cpu = torch.device("cpu")
    assert triton_attention.PROGRAMS_PER_SM == 8
    assert [triton_attention.decode_splits(r, 8, cpu) for r in (1, 2, 3, 5, 8, 16)] == [8, 4, 4, 2, 1, 1]
    assert [triton_attention.decode_splits(r, 1, cpu) for r in (1, 5, 16, 33, 64)] == [16, 16, 4, 2, 1]
    assert triton_attention.decode_splits(1, 1, cpu) <= triton_attention.MAX_SPLITS


def test_triton_self_check_and_its_refusal(interpret):
    assert triton_attention.self_check(torch.device("cpu"), torch.float32, 2, 4, 16, 16, 4)
    assert not triton_attention.self_check(torch.device("cpu"), torch.float32, 3, 4, 16, 16, 4)  # 4 heads over 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kv_write_is_the_indexed_copy(interpret, dtype):
    """A step's keys and values (the attention layer's [1, kv_heads, tokens, dim] views: transposed,
    K and V of different widths) into the pools at (block, offset) per token: exactly what the
    torch path's transposed copy and indexed write leave, every other slot untouched; a layout
    it does not take (last dim strided) is left to the torch path."""
    g = torch.Generator().manual_seed(3)
    nb, kvh, bs, d, dv, t = 9, 2, 4, 16, 24, 7
    kp = torch.randn((nb, kvh, bs, d), generator=g).to(dtype)
    vp = torch.randn((nb, kvh, bs, dv), generator=g).to(dtype)
    key = torch.randn((1, t, kvh, d), generator=g).to(dtype).transpose(1, 2)
    value = torch.randn((1, t, kvh, dv), generator=g).to(dtype).transpose(1, 2)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    blk, off = slots // bs, slots % bs
    ek, ev = kp.clone(), vp.clone()
    ek[blk, :, off] = key[0].transpose(0, 1)
    ev[blk, :, off] = value[0].transpose(0, 1)
    assert triton_attention.write_kv(key, value, kp, vp, blk, off)
    assert torch.equal(kp, ek) and torch.equal(vp, ev)
    assert not triton_attention.write_kv(key.transpose(2, 3).contiguous().transpose(2, 3), value, kp, vp, blk, off)


@pytest.mark.parametrize("chunk,flash", [(6, 1024), (64, 8)])
def test_engine_runs_through_the_triton_kernels_like_generate(interpret, monkeypatch, tmp_path, chunk, flash):
    """The engine with the Triton kernels as its attention (forced; interpreted): decode rows in the
    static decode step, prompt chunks in the prefill kernel (prompts in chunks of 6 tokens, so later
    chunks attend over cached blocks; two prompts with a common head, the second over the first's
    cached blocks); with whole prompts in a step and `flash` lowered to 8, fresh prompts of 8 tokens
    or more go through SDPA beside the kernel's chunks in the same step: generate()'s tokens, windows
    included."""
    from keyacc_ray.engine import runner

    monkeypatch.setenv("KEYACC_DECODE_ATTENTION", "triton")
    monkeypatch.setattr(runner, "FLASH_PROMPT_TOKENS", flash)
    path = _random_model(tmp_path, "Qwen3Config", head_dim=16, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=8, use_sliding_window=True)
    calls, writes = [], []
    real = triton_attention.paged_prefill
    monkeypatch.setattr(triton_attention, "paged_prefill", lambda *a: calls.append(a[5]) or real(*a))
    real_write = triton_attention.write_kv
    monkeypatch.setattr(triton_attention, "write_kv", lambda *a: writes.append(a[0].shape[2]) and real_write(*a))
    head = list(range(40, 52))
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((14, 3, 9))] + [head + [7, 8], head + [9]]
    max_tokens = [5, 9, 12, 6, 4]
    eng, outs, buckets = _generate_with_buckets(path, prompts, max_tokens, kv_block_size=4, max_prefill_tokens=chunk)
    assert eng.runner.attn.kernel == "triton" and eng.runner.paged
    for p, m, out in zip(prompts, max_tokens, outs):
        assert out == hf_greedy(path, p, m)
    assert {4, 2, 1} <= set(buckets) and eng.blocks.hits > 0
    assert calls and any(any(st > 0 for st in starts) for starts in calls)  # chunks over cached blocks too
    assert writes and min(writes) >= 1 and max(writes) > 1  # the pool written by the kernel, steps of all sizes


@pytest.mark.parametrize("asy", [False, True])
def test_the_gpu_decode_bench_runs_on_cpu(qwen3_path, asy):
    """scripts/bench_gpu_decode.py (what gpu_check.sh runs on the GPU host), here through the static
    decode step: every timed step is one decode call of the whole batch, its rows counted (prompts
    prefilled in 4-token chunks, so the first decodes for steps while the last prefills: none may
    finish before the timed steps); its figures are there.
    With --async-scheduling (step 2c) the timed steps are launched ahead, the forward not timed."""
    import json
    import subprocess
    import sys

    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu_decode.py"
    out = subprocess.run([sys.executable, str(script), "--model", qwen3_path, "--batches", "1", "3",
                          "--context", "20", "--steps", "2", "--dtype", "float32", "--max-prefill-tokens", "4", "--decode-graphs", "on",
                          "--cpu-kernels", "off"] + ["--async-scheduling"] * asy, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["paged"] and res["attention_kernel"] == "torch" and res["graphs_captured"] == []
    assert res["async_scheduling"] == asy
    for b in (1, 3):
        row = res[f"b{b}"]
        assert row["tokens_per_s"] > 0 and row["x_roofline"] > 0
        # every timed step decodes all b rows (none finished during the batch's prefill steps)
        assert row["rows_per_step"] == b and "finished_early" not in row and row["mean_context"] > 20
        # (asynchronous: each timed step launches the next one ahead)
        assert (row["forward_calls"], row["launched_ahead"]) == ((0, 2) if asy else (2, 0))
    assert res["prefill_tokens_per_s"] > 0 and res["weight_bytes"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window", [
    (4, 2, 64, 16, 0), (6, 2, 40, 8, 0), (8, 8, 32, 16, 5), (14, 2, 64, 4, 0), (4, 1, 16, 4, 7)])
def test_triton_paged_prefill_matches_sdpa_per_chunk(interpret, dtype, heads, kv_heads, dim, block_size, window):
    """A step's prompt chunks in one launch: fresh prompts and continuations over cached blocks,
    a one-token chunk, rows of the packed step that are not chunks (decode rows) left alone; the
    same as SDPA over each chunk's gathered keys with its causal (and window) mask."""
    import torch.nn.functional as F

    from keyacc_ray.engine.paged_attention import gather

    g = torch.Generator().manual_seed(heads * 10 + block_size)
    nb, width = 60, 20
    kp = torch.randn((nb, kv_heads, block_size, dim), generator=g).to(dtype)
    vp = torch.randn((nb, kv_heads, block_size, dim), generator=g).to(dtype)
    starts = [0, 9, 11, 0]
    q_lens = [min(n, width * block_size - s) for n, s in zip([5, 1, 37, 3], starts)]
    q_starts = [2, 8, 9, 10 + q_lens[2]]
    total = q_starts[-1] + q_lens[-1] + 2
    q = torch.randn((total, heads, dim), generator=g).to(dtype)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in q_lens]).to(torch.int32)
    out = torch.full((total, heads, dim), 7.0, dtype=dtype)
    scale = dim ** -0.5
    triton_attention.paged_prefill(q, kp, vp, tables, q_starts, q_lens, starts, window, scale, out, {})
    chunk_rows = set()
    for i, (s, t, st) in enumerate(zip(q_starts, q_lens, starts)):
        chunk_rows.update(range(s, s + t))
        ks = gather(kp.float(), tables[i][None].long(), st + t)
        vs = gather(vp.float(), tables[i][None].long(), st + t)
        qpos, kpos = torch.arange(st, st + t)[:, None], torch.arange(st + t)[None]
        mask = kpos <= qpos
        if window:
            mask &= qpos - kpos < window
        ref = F.scaled_dot_product_attention(q[s:s + t].transpose(0, 1)[None].float(), ks, vs, attn_mask=mask,
                                             scale=scale, enable_gqa=True)[0].transpose(0, 1)
        tol = 2e-6 if dtype == torch.float32 else 3e-3
        assert float((out[s:s + t].float() - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max()))
    others = [r for r in range(total) if r not in chunk_rows]
    assert bool((out[others] == 7.0).all())  # rows that are not chunks' untouched
