#!/usr/bin/env python3
"""Engine benchmark on this machine's CPU: prefill, batched decode, continuous batching against
transformers' generate(), and the batch-1 memory-bandwidth roofline. Prints a table and, as
its last line, one JSON object.

    make bench-engine            # builds models/bench-qwen3 (bf16, ~0.4B) if missing
    python scripts/bench_engine.py --model models/bench-qwen3 --threads 2
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch


def read_bandwidth_gbs(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: all but the input embedding (one row of it is
    read), unless the embedding is tied to the output head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    if emb.data_ptr() != out.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def rand_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def bench_decode(engine, batch: int, prompt_len: int, steps: int, rng) -> float:
    from keyacc_ray.engine.request import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", rand_prompt(rng, prompt_len, engine.runner.vocab_size), params)
    while engine.scheduler.num_waiting:
        engine.step()  # admission + prefill, not timed
    t = time.perf_counter()
    n = 0
    for _ in range(steps):
        n += len(engine.step())
    dt = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return n / dt


def hf_generate_tps(model, prompts: list[list[int]], new_tokens: list[int], pad_id: int) -> tuple[float, float]:
    """One static batch, left padded, run until its longest output is done. Returns
    (useful tokens / s, seconds)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    m = max(new_tokens)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False,
                       pad_token_id=pad_id, eos_token_id=None)
        dt = time.perf_counter() - t
    return sum(new_tokens) / dt, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-qwen3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    rng = random.Random(args.seed)
    bw = read_bandwidth_gbs(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=32, max_model_len=768,
                                    num_threads=args.threads))
    model = engine.runner.model
    wbytes = weight_bytes_per_step(model)
    roofline_ms = wbytes / (bw * 1e9) * 1e3
    vocab = engine.runner.vocab_size
    res: dict = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                 "weight_bytes_per_step": wbytes, "read_bw_gbs": round(bw, 1), "roofline_ms_bs1": round(roofline_ms, 2)}

    # prefill of a 512-token prompt (warm once)
    for i in range(2):
        engine.add_request(f"pf{i}", rand_prompt(rng, 512, vocab), SamplingParams(max_tokens=1, temperature=0))
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
    res["prefill_tps_512"] = round(512 / dt, 1)

    for b in (1, 8, 32):
        tps = bench_decode(engine, b, 128, args.steps, rng)
        res[f"decode_tps_bs{b}"] = round(tps, 1)
    res["decode_ms_bs1"] = round(1e3 / res["decode_tps_bs1"], 2)
    res["bs1_vs_roofline"] = round(res["decode_ms_bs1"] / roofline_ms, 2)
    res["bs32_vs_bs1"] = round(res["decode_tps_bs32"] / res["decode_tps_bs1"], 2)

    # transformers generate(): one request, and a static batch of 32
    pad = engine.tokenizer.pad_token_id or 0
    tps1, _ = hf_generate_tps(model, [rand_prompt(rng, 128, vocab)], [args.steps], pad)
    res["hf_generate_tps_bs1"] = round(tps1, 1)
    tps32, _ = hf_generate_tps(model, [rand_prompt(rng, 128, vocab) for _ in range(32)], [args.steps] * 32, pad)
    res["hf_generate_tps_static32"] = round(tps32, 1)

    # 32 mixed-length requests: continuous batching vs one static generate() batch
    prompts = [rand_prompt(rng, rng.randint(16, 256), vocab) for _ in range(32)]
    outs = [rng.randint(8, 64) for _ in range(32)]
    t = time.perf_counter()
    engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs])
    cb_s = time.perf_counter() - t
    _, hf_s = hf_generate_tps(model, prompts, outs, pad)
    res["cb_mixed32_s"] = round(cb_s, 2)
    res["hf_static_mixed32_s"] = round(hf_s, 2)
    res["cb_speedup_vs_hf_static"] = round(hf_s / cb_s, 2)

    width = max(map(len, res))
    for k, v in res.items():
        print(f"{k:<{width}}  {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
