#!/usr/bin/env python3
"""Engine benchmark on this machine's CPU, in one run: the plain torch path (transformers'
forward over the slot cache) and the CPU fast path (keyacc_ray/kernels), bf16 and weight-only
int8: prefill of 512 tokens, decode at batch 1, 8 and 32, the batch-1 read-bandwidth roofline,
greedy agreement between the paths, and continuous batching against transformers' generate();
then on the tiny model the engine's host time per decode step at batch 1 / 64 / 256
(`host_ms_b*`) and how many 2,000-token sequences a 65,536-token KV budget runs at once
(`paged_seqs_ratio`), from scripts/bench_host.py; then the fast path on every kernel path this
CPU runs (`prefill_tps_512_{isa}`, `decode_tps_bs{1,8,32}_{isa}` for amx / avx512 / avx2 /
portable, from scripts/bench_cpu_isa.py; `fast_path_isa` names the default). Prints a table
and, as its last line, one JSON object.

On a CPU without AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake) plain torch's bf16 runs at
about 25 tokens/s of prefill on two cores (32 prompts of 128 tokens take minutes), so there the
plain path decodes 8 steps instead of --steps and the transformers generate() comparisons are
skipped unless --hf (`plain_reduced` says so in the output): the run then finishes within 20
minutes on two cores.

    make bench-engine            # builds models/bench-qwen3 (bf16, ~0.4B) if missing
    python scripts/bench_engine.py --model models/bench-qwen3 --threads 2
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

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
    if emb is not out:  # tied weights are one Parameter (this also holds for a meta-device model)
        total -= emb.numel() * emb.element_size()
    return total


def rand_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def bench_decode(engine, batch: int, prompt_len: int, steps: int, rng) -> float:
    from keyacc_ray.engine.request import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", rand_prompt(rng, prompt_len, engine.runner.vocab_size), params)
    while engine.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in engine.seqs.values()):
        engine.step()  # admission + (chunked) prefill, not timed
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


def native_bf16() -> bool:
    """Whether this CPU computes in bf16 (AVX512-BF16 or AMX), which plain torch's bf16 products
    need to run at speed (Linux's flags; True where they cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bench_engine(args, rng, mode: str, quant: str, bw: float, res: dict, tag: str, steps: int | None = None):
    """Prefill and decode figures of one engine configuration, keys prefixed with `tag`."""
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=32, max_model_len=768,
                                    num_threads=args.threads, cpu_kernels=mode, cpu_weight_quant=quant))
    r = engine.runner
    if mode == "on":
        res[f"{tag}kernels"] = r.fast_path.summary() + f" fused_step={r.fused_step is not None}"
    vocab = r.vocab_size
    for i in range(2):  # prefill of a 512-token prompt (warm once)
        engine.add_request(f"pf{i}", rand_prompt(rng, 512, vocab), SamplingParams(max_tokens=1, temperature=0))
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
    res[f"{tag}prefill_tps_512"] = round(512 / dt, 1)
    for b in (1, 8, 32):
        res[f"{tag}decode_tps_bs{b}"] = round(bench_decode(engine, b, 128, steps or args.steps, rng), 1)
    res[f"{tag}decode_ms_bs1"] = round(1e3 / res[f"{tag}decode_tps_bs1"], 2)
    res[f"{tag}bs1_vs_roofline"] = round(res[f"{tag}decode_ms_bs1"] / res["roofline_ms_bs1"], 2)
    return engine


def greedy_outputs(engine, prompts, n: int) -> list[list[int]]:
    from keyacc_ray.engine.request import SamplingParams

    return engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)] * len(prompts))


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of outputs identical, mean share of each output before the first differing token)."""
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        prefix.append(k / len(x))
    return same, sum(prefix) / len(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-qwen3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers generate() comparisons")
    ap.add_argument("--hf", action="store_true",
                    help="run the generate() comparisons and all plain-path steps even on a CPU without AVX512-BF16")
    ap.add_argument("--tiny-model", default="models/tiny-qwen3", help="for the host-time and paged-KV figures")
    ap.add_argument("--no-isa-paths", action="store_true",
                    help="skip the per-kernel-path figures (scripts/bench_cpu_isa.py: every path this CPU runs)")
    args = ap.parse_args()

    from keyacc_ray.engine.request import SamplingParams
    from transformers import AutoConfig, AutoModelForCausalLM

    rng = random.Random(args.seed)
    torch.set_num_threads(args.threads)
    bw = read_bandwidth_gbs(args.threads)
    with torch.device("meta"):  # shapes and dtypes only: no second copy of the weights
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=getattr(torch, args.dtype))
    wbytes = weight_bytes_per_step(meta)
    roofline_ms = wbytes / (bw * 1e9) * 1e3
    res: dict = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                 "weight_bytes_per_step": wbytes, "read_bw_gbs": round(bw, 1), "roofline_ms_bs1": round(roofline_ms, 2)}

    # plain torch (transformers' forward over the slot cache), then the fast path, same run
    reduced = not native_bf16() and not args.hf
    if reduced:
        res["plain_reduced"] = ("no AVX512-BF16: plain torch decodes 8 steps a batch size, "
                                "generate() comparisons skipped (--hf runs them)")
    plain = bench_engine(args, rng, "off", "none", bw, res, "", steps=8 if reduced else None)
    res["bs32_vs_bs1"] = round(res["decode_tps_bs32"] / res["decode_tps_bs1"], 2)
    vocab = plain.runner.vocab_size
    cmp_prompts = [rand_prompt(rng, rng.randint(16, 128), vocab) for _ in range(16)]
    model = plain.runner.model
    if not args.skip_hf and not reduced:
        # transformers generate(): one request, and a static batch of 32
        pad = plain.tokenizer.pad_token_id or 0
        tps1, _ = hf_generate_tps(model, [rand_prompt(rng, 128, vocab)], [args.steps], pad)
        res["hf_generate_tps_bs1"] = round(tps1, 1)
        tps32, _ = hf_generate_tps(model, [rand_prompt(rng, 128, vocab) for _ in range(32)], [args.steps] * 32, pad)
        res["hf_generate_tps_static32"] = round(tps32, 1)
        # 32 mixed-length requests: continuous batching vs one static generate() batch
        prompts = [rand_prompt(rng, rng.randint(16, 256), vocab) for _ in range(32)]
        outs = [rng.randint(8, 64) for _ in range(32)]
        t = time.perf_counter()
        plain.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs])
        cb_s = time.perf_counter() - t
        _, hf_s = hf_generate_tps(model, prompts, outs, pad)
        res["cb_mixed32_s"] = round(cb_s, 2)
        res["hf_static_mixed32_s"] = round(hf_s, 2)
        res["cb_speedup_vs_hf_static"] = round(hf_s / cb_s, 2)
    ref_out = greedy_outputs(plain, cmp_prompts, 32)
    del plain, model

    fast = bench_engine(args, rng, "on", "none", bw, res, "fast_")
    fast_out = greedy_outputs(fast, cmp_prompts, 32)
    del fast
    q8 = bench_engine(args, rng, "on", "int8", bw, res, "int8_")
    q8_out = greedy_outputs(q8, cmp_prompts, 32)
    del q8

    res["fast_speedup_bs1"] = round(res["fast_decode_tps_bs1"] / res["decode_tps_bs1"], 2)
    res["fast_speedup_bs8"] = round(res["fast_decode_tps_bs8"] / res["decode_tps_bs8"], 2)
    res["fast_speedup_bs32"] = round(res["fast_decode_tps_bs32"] / res["decode_tps_bs32"], 2)
    res["fast_speedup_prefill"] = round(res["fast_prefill_tps_512"] / res["prefill_tps_512"], 2)
    res["fast_roofline_ratio_bs1"] = res["fast_bs1_vs_roofline"]
    res["int8_speedup_bs1_vs_fast"] = round(res["int8_decode_tps_bs1"] / res["fast_decode_tps_bs1"], 2)
    same, prefix = agreement(ref_out, fast_out)
    res["fast_vs_plain_greedy_identical"] = round(same, 3)
    res["fast_vs_plain_greedy_prefix"] = round(prefix, 3)
    same, prefix = agreement(fast_out, q8_out)
    res["int8_vs_bf16_greedy_identical"] = round(same, 3)
    res["int8_vs_bf16_greedy_prefix"] = round(prefix, 3)

    from bench_host import bench_host, paged_seqs_ratio, report

    res.update(bench_host(args.tiny_model))
    res.update(paged_seqs_ratio(args.tiny_model))
    if not args.no_isa_paths:
        res.update(isa_paths(args))
    report(res)


def isa_paths(args) -> dict:
    """`prefill_tps_512_{isa}` and `decode_tps_bs{1,8,32}_{isa}` for every kernel path this CPU
    runs (one subprocess each: the path is fixed per process), `fast_path_isa` the default one."""
    import json
    import subprocess
    import sys

    from keyacc_ray import kernels

    best = kernels.load().isa()
    paths = {"amx": ["amx", "avx512", "avx2", "portable"], "avx512bf16": ["avx512", "avx2", "portable"],
             "avx2": ["avx2", "portable"]}.get(best, ["portable"])
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("bench_cpu_isa.py")), "--model", args.model,
                        "--threads", str(args.threads), "--isa", *paths], capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    got = json.loads(lines[-1]) if lines else {"isa_paths_error": (r.stderr or r.stdout)[-300:]}
    got["isa_paths_roofline_ms_bs1"] = got.pop("roofline_ms_bs1", None)  # (its own reading: not this run's)
    return {"fast_path_isa": best, **{k: v for k, v in got.items() if k not in ("model", "threads")}}


if __name__ == "__main__":
    main()
