#!/usr/bin/env python3
"""The engine's decode speed on one device, against the memory roofline (issue #21).

For each batch size B: B requests with random prompts of --context tokens (prefilled first, chunked
as the engine does; those prefilled first decode meanwhile, so each may generate --headroom tokens
and none finishes before the timed steps), then --steps decode steps of all B rows (counted:
`rows_per_step`, tokens/s from the tokens the steps returned) timed through `LLMEngine.step` (the
forward, CUDA-graph replay where captured, sampling and postprocessing: what a replica does per
step). Reports per batch: tokens/s, ms per step, the step against the roofline (bytes the step must
read, the weights once and every row's KV, over the device's copy bandwidth measured in the same
run), the forward's share (the runner's decode call, synchronised), the process's CPU time per step;
and once: prefill tokens/s (the largest batch's prompts), whether the decode step runs as CUDA
graphs and at which sizes, the decode-attention kernel.

    python scripts/bench_gpu_decode.py --model PATH --batches 1 16 64 256 --context 1024
    python scripts/bench_gpu_decode.py --model models/tiny-qwen3 --batches 1 4 --context 64 --steps 4   # CPU
    python scripts/bench_gpu_decode.py --model PATH --batches 64 256 --async-scheduling   # step n+1 launched before n is read
    python scripts/bench_gpu_decode.py --model PATH --batches 1 64 --profile-steps 4   # + each batch's top kernels

With --async-scheduling the forward is not timed on its own (a synchronising wrapper would undo the
overlap): `forward_ms` is null, `launched_ahead` counts the decode steps launched ahead.

The last line is one JSON object. The roofline's bandwidth is a device-to-device copy's (bytes read
plus written over its time; on CPU a 2-thread-or-more `torch.sum`'s read rate); the weights counted
are every parameter but an untied input embedding (a step reads B of its rows).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from keyacc_ray.config import EngineConfig  # noqa: E402
from keyacc_ray.engine.llm_engine import LLMEngine  # noqa: E402
from keyacc_ray.engine.request import SamplingParams  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bandwidth(dev: torch.device) -> float:
    """Bytes/s: a device copy's traffic (CUDA), or a sum's read rate (CPU); best of 5."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 28)
    x = torch.ones(n // 2, dtype=torch.float16, device=dev)
    best = float("inf")
    y = torch.empty_like(x)
    for _ in range(5):
        sync(dev)
        t = time.perf_counter()
        if dev.type == "cuda":
            y.copy_(x)
        else:
            x.sum()
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return (2 * n if dev.type == "cuda" else n) / best


def weight_bytes(model) -> int:
    """Bytes of every weight a decode step reads: parameters and buffers (the CPU fast path keeps its
    packed weights as buffers), each tensor once, less an untied input embedding."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    if not getattr(model.config, "tie_word_embeddings", False):
        emb = model.get_input_embeddings().weight
        total -= emb.numel() * emb.element_size()
    return total


def profile_steps(eng: LLMEngine, dev: torch.device, n: int, top: int = 10) -> dict:
    """n engine steps under torch.profiler: per step, the device time of all kernels and the `top`
    kernels (CUDA; their launches from CUDA-graph replays included) or host ops (CPU) by time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            eng.step()
        sync(dev)
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if cuda:  # the kernels themselves (device-side events), not the host ops that launched them
            t = e.self_device_time_total if e.device_type == DeviceType.CUDA else 0
        else:
            t = e.self_cpu_time_total
        if t > 0:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows)
    return {"steps": n, "us_per_step": round(total / n, 1), "by": "device" if cuda else "cpu",
            "top": [{"us_per_step": round(t / n, 1), "calls_per_step": round(c / n, 1), "name": k[:90]}
                    for t, c, k in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    ap.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--decode-graphs", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--async-scheduling", action="store_true", help="EngineConfig.async_scheduling")
    ap.add_argument("--headroom", type=int, default=1024, help="tokens each request may generate (prefill "
                    "steps of the batch + warm-up + timed steps must fit)")
    ap.add_argument("--profile-steps", type=int, default=0, help="after each batch's timed steps, this many "
                    "more under torch.profiler: the step's top kernels by device time (CPU: by CPU time)")
    ap.add_argument("--cpu-kernels", default="auto", choices=["auto", "off"], help="on CPU (off: the paged "
                    "model forward a GPU runs, e.g. with --decode-graphs on)")
    args = ap.parse_args()

    # Prompts prefilled in earlier steps decode while later ones prefill (chunked prefill mixes
    # them), so every request may generate up to HEADROOM tokens: none finishes before the timed
    # steps, which then run all B rows (counted, not assumed); the rest is aborted after them.
    new = args.headroom
    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batches),
                       max_model_len=args.context + new + 8, max_prefill_tokens=args.max_prefill_tokens,
                       enable_prefix_caching=False, decode_graphs=args.decode_graphs, cpu_kernels=args.cpu_kernels, max_waiting=max(args.batches),
                       async_scheduling=args.async_scheduling)
    t0 = time.perf_counter()
    eng = LLMEngine(cfg)
    load_s = time.perf_counter() - t0
    r = eng.runner
    dev = r.device
    new = min(new, r.max_model_len - args.context)  # (a model with fewer positions: less headroom)
    bw = bandwidth(dev)
    wbytes = weight_bytes(r.model)
    kv_tok = r.kv_bytes_per_token()
    out = {"device": r.device_label(), "model": args.model, "dtype": args.dtype, "context": args.context,
           "load_s": round(load_s, 1), "attention_kernel": r.attn.kernel, "paged": r.paged,
           "fused_step": r.fused_step is not None, "fused_ops": r.fused_ops, "graphs_captured": r.graphs_captured,
           "graph_capture_s": round(r.static_decode.capture_s, 2) if r.static_decode else 0.0,
           "graph_failure": r.static_decode.failure if r.static_decode else "",
           "bandwidth_gbs": round(bw / 1e9, 1), "weight_bytes": wbytes, "num_kv_blocks": r.num_blocks,
           "async_scheduling": eng.async_scheduling}
    print(json.dumps(out), flush=True)

    fwd = []  # the runner's decode calls, synchronised: (seconds)
    real = r.decode

    def timed(*a):
        sync(dev)
        t = time.perf_counter()
        got = real(*a)
        sync(dev)
        fwd.append(time.perf_counter() - t)
        return got

    rng = random.Random(0)
    vocab = r.vocab_size
    for b in args.batches:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for i in range(b):
            eng.add_request(f"b{b}-{i}", [rng.randrange(3, vocab) for _ in range(args.context)], params)
        sync(dev)
        t = time.perf_counter()
        steps = 0
        while any(s.num_output_tokens == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
            steps += 1
        sync(dev)
        prefill_s = time.perf_counter() - t
        for _ in range(args.warmup - 1):
            eng.step()
        if not eng.async_scheduling:
            r.decode = timed
        fwd.clear()
        ahead = eng.steps_launched_ahead
        running = list(eng.scheduler.running)
        ctx0 = sum(q.num_tokens for q in running)
        sync(dev)
        t, c = time.perf_counter(), time.process_time()
        tokens = 0
        for _ in range(args.steps):
            tokens += sum(len(o.new_token_ids) for o in eng.step())
        sync(dev)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        r.decode = real
        ahead = eng.steps_launched_ahead - ahead
        ctx = (ctx0 + sum(q.num_tokens for q in running)) / 2  # keys every row attends over, mid-way
        prof = profile_steps(eng, dev, args.profile_steps) if args.profile_steps else None
        finished_early = sum(q.num_output_tokens >= new for q in running)
        for q in list(eng.scheduler.running) + list(eng.scheduler.waiting):
            eng.abort(q.request_id)
        while eng.has_unfinished():
            eng.step()
        step_s = wall / args.steps
        roof_s = (wbytes + ctx * kv_tok) / bw
        row = {"batch": b, "rows_per_step": round(tokens / args.steps, 2), "tokens_per_s": round(tokens / wall, 1),
               "step_ms": round(step_s * 1e3, 3), "mean_context": round(ctx / max(1, len(running)), 1),
               "roofline_ms": round(roof_s * 1e3, 3), "x_roofline": round(step_s / roof_s, 2),
               "forward_ms": round(1e3 * sum(fwd) / len(fwd), 3) if fwd else None, "forward_calls": len(fwd),
               "launched_ahead": ahead,
               "cpu_ms_per_step": round(cpu / args.steps * 1e3, 3),
               "prefill_tokens_per_s": round(b * args.context / prefill_s, 1), "prefill_steps": steps}
        if finished_early:
            row["finished_early"] = finished_early  # (raise --headroom: the figures are not B rows')
        if prof is not None:
            row["profile"] = prof
        out[f"b{b}"] = row
        print(json.dumps(row), flush=True)
    big = out[f"b{max(args.batches)}"]
    out["prefill_tokens_per_s"] = big["prefill_tokens_per_s"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
