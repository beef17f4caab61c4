#!/usr/bin/env python3
"""The CPU fast path on every kernel path this CPU runs, one subprocess per path (the path is
picked once per process from KEYACC_CPU_ISA): prefill of a 512-token prompt and decode at batch
1, 8 and 32, the same bf16 model and thread count for each. Paths: amx (AVX512-BF16 with AMX
tiles for products of 8 rows or more), avx512 (AVX512-BF16 alone), avx2 (AVX2 + FMA: the linear
kernel written for CPUs without AVX-512), portable (the compiler's own vectorisation; slow:
fewer steps). Prints a table, then one JSON line with
`prefill_tps_512_{isa}`, `decode_tps_bs{1,8,32}_{isa}` and `bs1_vs_roofline_{isa}` (a batch-1
step against the time to read the step's weights once at this machine's measured read
bandwidth, as bench_engine.py's `fast_roofline_ratio_bs1`). This VM's read bandwidth moves by
20-30% between minutes, so each path's batch-1 figure is the median of three runs of --steps
steps, set against the faster of two bandwidth readings (one at the start, one in the path's own
process right before its batch-1 steps; `roofline_ms_bs1_{isa}`).

    python scripts/bench_cpu_isa.py --model models/bench-qwen3 --threads 2
    python scripts/bench_cpu_isa.py --model M --isa amx avx512        # only these
    python scripts/bench_cpu_isa.py --isa amx avx2 --context 1000     # decode over 1k-token contexts
    python scripts/bench_cpu_isa.py --isa amx --kernel-times           # + ms a step in each kernel
                                                                       # (the layer loop in Python then)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


KERNEL_CALLS = ("linear_bf16", "linear_int8", "paged_decode_attention", "rope_kv_write", "add_rms_norm", "rms_norm",
                "silu_mul")


def _time_kernel_calls(K, acc: dict) -> None:
    """Wrap the decode step's kernel calls so that each one's wall time adds up in acc[name]
    (the step looks them up on the module at every call; a few us of overhead per call)."""
    for name in KERNEL_CALLS:
        fn = getattr(K, name, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, _name=name):
            t = time.perf_counter()
            out = _fn(*a)
            acc[_name] = acc.get(_name, 0.0) + time.perf_counter() - t
            return out

        setattr(K, name, timed)


def measure(model: str, threads: int, steps: int, context: int = 128, kernel_times: bool = False) -> dict:
    """In this process, on the path KEYACC_CPU_ISA names."""
    import random

    import torch

    sys.path.insert(0, str(ROOT))
    from keyacc_ray import kernels
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams

    torch.set_num_threads(threads)
    eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", max_num_seqs=32,
                                 max_model_len=max(768, context + 3 * steps + 8),
                                 num_threads=threads, cpu_kernels="on"))
    rng = random.Random(0)
    vocab = eng.runner.vocab_size
    res = {"isa": kernels.load().isa()}
    acc: dict = {}
    if kernel_times:
        _time_kernel_calls(kernels.load(), acc)
        if eng.runner.fused_step is not None:  # the layers' loop in Python, so each kernel call is seen
            eng.runner.fused_step.native = None
    for i in range(2):  # warm once
        eng.add_request(f"p{i}", [rng.randrange(10, vocab - 1) for _ in range(512)], SamplingParams(max_tokens=1))
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
    while eng.has_unfinished():
        eng.step()
    res["prefill_tps_512"] = round(512 / dt, 1)
    for b in (1, 8, 32):
        # batch 1 is set against the read roofline: the bandwidth read again right before it (this
        # VM's moves by 20-30% between minutes), and the median of three runs of `steps` steps
        reps = 3 if b == 1 else 1
        if b == 1:
            sys.path.insert(0, str(ROOT / "scripts"))
            from bench_engine import read_bandwidth_gbs

            res["read_bw_gbs"] = round(read_bandwidth_gbs(threads), 2)
        for i in range(b):
            eng.add_request(f"d{b}-{i}", [rng.randrange(10, vocab - 1) for _ in range(context)],
                            SamplingParams(max_tokens=steps * reps + 2, temperature=0, ignore_eos=True))
        while any(s.num_output_tokens == 0 for s in eng.seqs.values()):
            eng.step()
        acc.clear()
        rates, total = [], 0.0
        for _ in range(reps):
            t = time.perf_counter()
            n = sum(len(eng.step()) for _ in range(steps))
            dt = time.perf_counter() - t
            rates.append(n / dt)
            total += dt
        res[f"decode_tps_bs{b}"] = round(sorted(rates)[len(rates) // 2], 1)
        if kernel_times:  # ms per step in each kernel, and the step's own
            res[f"step_ms_bs{b}"] = round(total / (steps * reps) * 1e3, 1)
            for name, v in acc.items():
                res[f"kernel_ms_bs{b}_{name}"] = round(v / (steps * reps) * 1e3, 1)
        while eng.has_unfinished():
            eng.step()
    return res


def _roofline(model: str, threads: int) -> tuple[int, float]:
    """(the bytes of weights a batch-1 step reads, the measured read bandwidth in GB/s), as
    bench_engine.py measures them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_engine import read_bandwidth_gbs, weight_bytes_per_step

    bw = read_bandwidth_gbs(threads)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.bfloat16)
    return weight_bytes_per_step(meta), bw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-qwen3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--isa", nargs="*", default=["amx", "avx512", "avx2", "portable"])
    ap.add_argument("--kernel-times", action="store_true",
                    help="also ms per decode step in each kernel (linear, attention, rope, norms, SiLU); the "
                         "fused step then loops over the layers in Python, so that each call is seen")
    ap.add_argument("--context", type=int, default=128,
                    help="prompt tokens of each decoding sequence (the KV its attention reads)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.threads, args.steps, args.context, args.kernel_times)))
        return
    out: dict = {"model": args.model, "threads": args.threads, "context": args.context}
    wbytes, bw = _roofline(args.model, args.threads)
    out["roofline_ms_bs1"] = round(wbytes / (bw * 1e9) * 1e3, 2)
    for isa in args.isa:
        steps = max(2, args.steps // 4) if isa == "portable" else args.steps
        env = {**os.environ, "KEYACC_CPU_ISA": isa}
        r = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--threads", str(args.threads),
                            "--steps", str(steps), "--context", str(args.context)]
                           + (["--kernel-times"] if args.kernel_times else []),
                           env=env, capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not lines:
            out[f"error_{isa}"] = (r.stderr or r.stdout)[-300:]
            continue
        got = json.loads(lines[-1])
        if isa != "portable" and got["isa"] != {"amx": "amx", "avx512": "avx512bf16", "avx2": "avx2"}[isa]:
            out[f"skipped_{isa}"] = f"this CPU runs {got['isa']} at most"
            continue
        for k, v in got.items():
            if k != "isa":
                out[f"{k}_{isa}"] = v
        # the roofline of the faster of the two bandwidth readings (at the start, and in the path's
        # own process right before its batch-1 steps): the stricter bound
        roofline_ms = wbytes / (max(bw, got.get("read_bw_gbs", 0.0)) * 1e9) * 1e3
        out[f"roofline_ms_bs1_{isa}"] = round(roofline_ms, 2)
        out[f"bs1_vs_roofline_{isa}"] = round(1e3 / got["decode_tps_bs1"] / roofline_ms, 2)
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
