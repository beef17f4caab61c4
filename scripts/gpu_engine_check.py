#!/usr/bin/env python3
"""Engine correctness on a GPU host: GPU prefill, CPU decode continuation, tokens compared with
GPU-only decoding (and the move back, CPU -> GPU). bf16 uses the tie-aware rule: where the runs
first differ, the moved run's token must be within a few bf16 rounding steps of the GPU's best
logit at that point. Writes one JSON file; exits 1 if a comparison fails.

    python scripts/gpu_engine_check.py --model /path/to/model --out out/engine_check.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch


def tie_ok(model, prompt, ref, got, device, ulps=3) -> tuple[bool, int | None, float | None]:
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + ref[:i]], device=device)).logits[0, -1].float().cpu()
            top = float(logits.max())
            step = 2.0 ** (torch.floor(torch.log2(torch.tensor(abs(top) + 1e-6))).item() - 7)
            gap = float(top - logits[b])
            return gap <= max(0.05, ulps * step), i, gap
    return len(ref) == len(got), None, None


def run_cached(eng, rid: str, prompt: list[int], params) -> tuple[list[int], int | None]:
    """One request to its end: its tokens, and the prompt tokens it found cached."""
    eng.add_request(rid, prompt, params)
    got, cached = [], None
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
            cached = o.num_cached_tokens if cached is None else cached
    return got, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new", type=int, default=12)
    ap.add_argument("--cpu-kernels", default="auto", choices=["auto", "off"],
                    help="the CPU engine's kernels (off: no build; the torch path decodes)")
    ap.add_argument("--moved-after", type=int, default=3, help="tokens decoded on the first device before a move")
    args = ap.parse_args()

    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams
    from keyacc_ray.hw import topology

    res: dict = {"model": args.model, "dtype": args.dtype, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        res["gpu"] = torch.cuda.get_device_name(0)
    res["topology"] = topology.describe() if hasattr(topology, "describe") else None
    t = time.time()
    gpu = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="auto", max_num_seqs=8, max_model_len=2048))
    res["gpu_load_s"] = round(time.time() - t, 1)
    res["gpu_device"] = gpu.runner.device_label()
    res["gpu_kv_blocks"] = gpu.runner.num_blocks  # the paged pool gpu_memory_utilization left room for
    res["gpu_kv_tokens"] = gpu.runner.num_blocks * gpu.runner.block_size
    res["gpu_paged_attention"] = gpu.runner.paged
    t = time.time()
    cpu = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", max_num_seqs=4, max_model_len=2048,
                                 num_threads=max(1, (os.cpu_count() or 2) - 2), cpu_kernels=args.cpu_kernels))
    res["cpu_load_s"] = round(time.time() - t, 1)
    res["cpu_kernels"] = cpu.runner.fast_path.summary() if cpu.runner.fast_path else "off"
    res["cpu_fused_step"] = cpu.runner.fused_step is not None

    rng = random.Random(0)
    vocab = gpu.runner.vocab_size
    prompts = [[rng.randrange(10, min(vocab, 30000)) for _ in range(args.prompt_len)] for _ in range(2)]
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)

    def run(eng, rid, prompt, k):
        eng.add_request(rid, prompt, params)
        out = []
        while len(out) < k:
            for o in eng.step():
                if o.request_id == rid:
                    out += o.new_token_ids
        return out

    def drain(eng, rid):
        out = []
        while eng.has_unfinished():
            for o in eng.step():
                if o.request_id == rid:
                    out += o.new_token_ids
        return out

    checks, ok_all = [], True
    for i, prompt in enumerate(prompts):
        t = time.time()
        ref = gpu.generate([prompt], [params])[0]
        gpu_s = time.time() - t
        for direction in ("gpu->cpu", "cpu->gpu"):
            src, dst = (gpu, cpu) if direction == "gpu->cpu" else (cpu, gpu)
            rid = f"{direction}-{i}"
            t = time.time()
            first = run(src, rid, prompt, args.moved_after)
            t_src = time.time() - t
            t = time.time()
            pkg = src.export_request(rid)
            t_export = time.time() - t
            t = time.time()
            dst.import_request(pkg)
            rest = drain(dst, rid)
            t_dst = time.time() - t
            got = first + rest
            ok, at, gap = tie_ok(gpu.runner.model, prompt, ref, got, gpu.runner.device)
            ok_all &= ok
            checks.append({"prompt": i, "direction": direction, "identical": got == ref, "tie_aware_ok": ok,
                           "first_difference_at": at, "logit_gap": gap, "src_s": round(t_src, 3),
                           "export_s": round(t_export, 4), "dst_s": round(t_dst, 3),
                           "kv_bytes": int(pkg.keys.nbytes + pkg.values.nbytes), "gpu_only_s": round(gpu_s, 3)})
            print(json.dumps(checks[-1]), flush=True)
    res["checks"] = checks
    # Prefix caching and the host / disk KV tiers on this device: a pool of a few blocks, prompts
    # pushed out to the tiers, then sent again: loaded back (pinned host memory -> device), the
    # same tokens as the first time (tie-aware in bf16).
    refs = {i: gpu.generate([p], [params])[0] for i, p in enumerate(prompts)}
    model = gpu.runner.model
    del gpu, src, dst  # (the block pool: most of the device)
    gc.collect()  # (a runner and its captured decode graphs refer to each other: freed by the collector)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    blocks = 2 * -(-(args.prompt_len + args.new) // 16)
    node_dir = tempfile.mkdtemp(prefix="keyacc-check-node-")  # (the node's shared tier, below: this run's own)
    t = time.time()
    small = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="auto", max_num_seqs=1,
                                   max_model_len=blocks * 16, num_kv_blocks=blocks, kv_host_tier_gb=0.25,
                                   kv_disk_tier_gb=0.25, kv_node_tier_gb=0.25, kv_node_tier_dir=node_dir))
    others = [[rng.randrange(10, min(vocab, 30000)) for _ in range(args.prompt_len)] for _ in range(3)]
    for p in prompts[:1] + others:
        small.generate([p], [params])
    got, cached = run_cached(small, "again", prompts[0], params)
    ok, at, gap = tie_ok(model, prompts[0], refs[0], got, small.runner.device)
    tiers = small.stats().kv_tiers
    loaded = sum(t["loaded_blocks"] for t in tiers["tiers"].values())
    res["tiers_check"] = {"cached_tokens": cached, "identical": got == refs[0], "tie_aware_ok": ok,
                          "first_difference_at": at, "loaded_blocks": loaded, "tiers": tiers,
                          "s": round(time.time() - t, 2)}
    print(json.dumps(res["tiers_check"]), flush=True)
    # loaded back, or (the cost model's choice: computing was cheaper) computed again, same tokens
    ok_all &= ok and (loaded > 0 or tiers["recomputed_blocks"] > 0) and cached is not None
    # The node's shared tier across devices: an engine on the CPU (as a CPU pool's) asked the first
    # prompt again loads the blocks the device's engine wrote there when it finished, and gives
    # the device's tokens (tie-aware).
    t = time.time()
    host = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", max_num_seqs=1,
                                  max_model_len=blocks * 16, num_kv_blocks=blocks, kv_node_tier_gb=0.25,
                                  kv_node_tier_dir=node_dir))
    got, cached = run_cached(host, "node", prompts[0], params)
    ok, at, gap = tie_ok(model, prompts[0], refs[0], got, small.runner.device)
    node = host.stats().kv_tiers["tiers"]["node"]
    res["node_tier_check"] = {"cached_tokens": cached, "identical": got == refs[0], "tie_aware_ok": ok,
                              "first_difference_at": at, "loaded_blocks": node["loaded_blocks"],
                              "s": round(time.time() - t, 2)}
    print(json.dumps(res["node_tier_check"]), flush=True)
    ok_all &= ok and (node["loaded_blocks"] > 0 or host.stats().kv_tiers["recomputed_blocks"] > 0)
    shutil.rmtree(node_dir, ignore_errors=True)
    res["ok"] = ok_all
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({"engine_check_ok": ok_all, "out": args.out}))
    raise SystemExit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
