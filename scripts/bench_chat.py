#!/usr/bin/env python3
"""Multi-turn chat against the Serve graph with the prefix cache off and on (keyacc_ray/bench/chat.py):
conversations sharing a system prompt, each turn resending the whole history, all at once, streamed.

Per configuration: TTFT p50/p99 of first and follow-up turns, output tokens/s, the share of prompt
tokens served from the cache (usage.prompt_tokens_details.cached_tokens). Starts its own Ray and
serves the graph once per configuration (the "GPU" pool emulated on CPU 0, policy gpu_only: every
turn on the pool whose cache is measured; the CPU pool on CPU 1, idle), on a small float32
Qwen3-shaped model made here (models/chat-qwen3: hidden 256, 4 layers, a 4096-token context).
Configurations:
  off      prefix caching off, a KV budget that holds the whole working set
  on       prefix caching on, the same budget
  on_small prefix caching on, a budget of a quarter of the working set (--small-fraction; at
           least the longest conversation): what eviction costs without lower tiers (the running
           sequences may outgrow it: the newest are preempted, and find their blocks cached)
  host     on_small's block pool with a host-memory tier under it that holds the whole working set
  host_disk on_small's block pool, a host tier of another quarter of the working set, and a disk
           tier (under --disk-dir) for the rest
  stage    prefix caching on, ample budgets, every turn pinned `stage` (prefill on the GPU pool,
           decode on the CPU pool, whose cache then holds the system prompt and the histories):
           hand-offs leave out the head the CPU pool caches (kv_handoff_skip)
  stage_full the same with kv_handoff_skip off: every hand-off carries all its K/V
  stage_small stage with the CPU pool's block pool at on_small's budget (a quarter of the working
           set): it lets histories go, and a hand-off that left out a head it no longer holds
           is computed again there (unless its engine's KV events told the router)
  (stage configurations also report the hand-offs' bytes and time, from /metrics)
  alternate prefix caching on, ample budgets on both pools, each conversation's turns sent whole
           to the GPU pool and the CPU pool by turns (`gpu`, `cpu`, `gpu`, ...; the other way round
           for every second conversation): a turn finds its history only where it ran before
  alternate_node the same with the node's shared KV tier on both pools (kv_node_tier_gb, holding
           the working set): a turn loads the history the other pool computed

    python scripts/bench_chat.py                       # 32 conversations, 4-8 turns, 1,500-token system prompt
    python scripts/bench_chat.py --conversations 8 --system-tokens 600 --configs off on

Its last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyacc_ray.bench.chat import ChatWorkload, run_chat, summarize  # noqa: E402

MODEL_NAME = "chat-qwen3"
BLOCK = 16


def working_set_tokens(wl: ChatWorkload) -> int:
    """Distinct tokens whose KV the whole run could keep: the system prompt once, every user
    message and reply."""
    system, convs = wl.plan()
    return len(system) + sum(len(u) + wl.output_tokens for c in convs for u in c)


def longest_tokens(wl: ChatWorkload) -> int:
    system, convs = wl.plan()
    return max(len(system) + sum(len(u) + wl.output_tokens for u in c) for c in convs)


def block_bytes(model: Path) -> int:
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    item = 4 if c.get("torch_dtype", c.get("dtype", "float32")) == "float32" else 2
    return c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * item * BLOCK


def app_config(args, model: Path, caching: bool, kv_blocks: int, tiers: dict | None = None,
               two_pools: str | None = None, cpu_blocks: int | None = None) -> dict:
    """`two_pools`: the configuration's name where its turns run on both pools (stage*,
    alternate*): the CPU pool as large as the GPU pool (or `cpu_blocks`)."""
    cpu_seqs = args.gpu_seqs if two_pools else 4
    both = (tiers or {}) if two_pools and two_pools.startswith("alternate") else {}  # (the node's tier: both pools)
    return {
        "model": str(model), "max_model_len": args.max_model_len, "policy": "gpu_only",
        "kv_handoff_skip": two_pools != "stage_full",
        "gpu": {"device": "auto", "max_num_seqs": args.gpu_seqs, "num_kv_blocks": kv_blocks, "num_threads": 1,
                "num_cpus": 0.5, "cpu_affinity": [0], "enable_prefix_caching": caching,
                "max_prefill_tokens": args.max_prefill_tokens, "max_waiting": 256, "max_queued_requests": 256,
                **(tiers or {})},
        "cpu": {"device": "cpu", "max_num_seqs": cpu_seqs, "num_threads": 1, "num_cpus": 0.5, "cpu_affinity": [1],
                "enable_prefix_caching": caching, "num_kv_blocks": (cpu_blocks or kv_blocks) if two_pools else None,
                "max_prefill_tokens": args.max_prefill_tokens, "max_waiting": 256, "max_queued_requests": 256, **both},
    }


HANDOFF_SERIES = {"handoff_bytes": "keyacc_handoff_bytes_total", "handoffs": "keyacc_handoffs_total",
                  "handoff_seconds_sum": "keyacc_handoff_seconds_sum",
                  "skipped_tokens": "keyacc_kv_handoff_skipped_tokens_total",
                  "cached_tokens": "keyacc_kv_handoff_cached_tokens_total",
                  "recomputed_tokens": "keyacc_kv_handoff_recomputed_tokens_total"}


def handoff_figures(url: str) -> dict:
    """The hand-off series of /metrics, summed over their labels."""
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out = dict.fromkeys(HANDOFF_SERIES, 0.0)
    for line in text.splitlines():
        for k, name in HANDOFF_SERIES.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[k] += float(line.rsplit(" ", 1)[1])
    return out


def alternate(conversation: int, turn: int) -> str:
    """alternate*: each conversation's turns to the GPU pool and the CPU pool by turns."""
    return "gpu" if (conversation + turn) % 2 == 0 else "cpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configs = ["off", "on", "on_small", "host", "host_disk", "stage", "stage_full", "stage_small", "alternate",
               "alternate_node"]
    ap.add_argument("--configs", nargs="+", default=configs[:5], choices=configs)
    ap.add_argument("--small-fraction", type=float, default=0.25,
                    help="on_small, host, host_disk: the block pool as a share of the working set")
    ap.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: the temp dir)")
    ap.add_argument("--node-dir", default=None,
                    help="alternate_node: the node tier's directory (default: a fresh one under /dev/shm or the temp dir)")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--min-turns", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--gpu-seqs", type=int, default=32, help="the emulated GPU pool's max_num_seqs (every conversation at once)")
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args()

    model = Path(args.model_path) if args.model_path else ROOT / "models" / MODEL_NAME
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_model.py"), "--size", "small",
                        "--max-positions", "4096", "--out", str(model)], check=True)
    wl = ChatWorkload(args.conversations, args.system_tokens, args.min_turns, args.max_turns, args.user_tokens,
                      args.output_tokens, seed=args.seed)
    ws, longest = working_set_tokens(wl), longest_tokens(wl)
    assert longest < args.max_model_len, f"a conversation of {longest} tokens exceeds --max-model-len"
    # what the running sequences may hold at once: the system prompt (shared) and each one's own turns
    running = math.ceil((args.system_tokens + args.gpu_seqs * (longest - args.system_tokens)) / BLOCK) + args.gpu_seqs
    ample = math.ceil(ws / BLOCK) + running
    small = max(math.ceil(ws * args.small_fraction / BLOCK), math.ceil(longest / BLOCK) + 1)
    gib = block_bytes(model) / 2**30
    # a fresh node tier for this run (a rerun would otherwise find the last run's blocks there)
    node_dir = args.node_dir or tempfile.mkdtemp(prefix="keyacc-bench-node-",
                                                 dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    tiers = {"host": {"kv_host_tier_gb": ample * gib},
             "host_disk": {"kv_host_tier_gb": math.ceil(ws / 4 / BLOCK) * gib, "kv_disk_tier_gb": ample * gib,
                           "kv_disk_tier_dir": args.disk_dir},
             "alternate_node": {"kv_node_tier_gb": ample * gib, "kv_node_tier_dir": node_dir}}
    print(json.dumps({"working_set_tokens": ws, "longest_conversation_tokens": longest,
                      "kv_blocks": {"ample": ample, "small": small}, "block_bytes": block_bytes(model)}), flush=True)

    import ray
    from ray import serve

    from keyacc_ray.serve.app import apply_cluster_env, build_app

    apply_cluster_env()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    name = model.name
    results = {}
    try:
        for cfg_name in args.configs:
            two_pools = cfg_name if cfg_name.startswith(("stage", "alternate")) else None
            blocks = ample if cfg_name in ("off", "on") or two_pools else small
            serve.run(build_app(app_config(args, model, cfg_name != "off", blocks, tiers.get(cfg_name), two_pools,
                                           small if cfg_name == "stage_small" else None)),
                      name="keyacc", route_prefix="/")
            route = "stage" if cfg_name.startswith("stage") else None
            if cfg_name.startswith("alternate"):
                route = alternate
            warm = ChatWorkload(2, 64, 1, 1, 16, 4, seed=args.seed + 1000)  # kernels and paths warmed, no shared head
            asyncio.run(run_chat(url, name, warm, route=route))
            time.sleep(1.0)
            before = handoff_figures(url) if cfg_name.startswith("stage") else None
            turns, wall = asyncio.run(run_chat(url, name, wl, route=route))
            res = summarize(turns, wall)
            res["kv_blocks"] = blocks
            if cfg_name.startswith("stage"):
                time.sleep(3.0)  # the replicas' last load reports (their counters) reach the monitor
                after = handoff_figures(url)
                d = {k: after[k] - before[k] for k in after}
                n = max(1.0, d["handoffs"])
                res.update({"handoffs": int(d["handoffs"]), "handoff_mb_per_turn": round(d["handoff_bytes"] / n / 1e6, 3),
                            "handoff_ms_mean": round(d["handoff_seconds_sum"] / n * 1e3, 2),
                            "kv_skipped_tokens": int(d["skipped_tokens"]), "kv_cached_tokens": int(d["cached_tokens"]),
                            "kv_recomputed_tokens": int(d["recomputed_tokens"])})
            results[cfg_name] = res
            print(json.dumps({cfg_name: res}), flush=True)
            errs = sorted({t.error for t in turns if not t.ok})[:3]
            if errs:
                print(f"{cfg_name}: failed turns, e.g. {errs}", file=sys.stderr)
            serve.delete("keyacc")
    finally:
        serve.shutdown()
        ray.shutdown()
        if not args.node_dir:
            shutil.rmtree(node_dir, ignore_errors=True)
    out = {"workload": {"conversations": wl.conversations, "system_tokens": wl.system_tokens,
                        "turns": [wl.min_turns, wl.max_turns], "user_tokens": wl.user_tokens,
                        "output_tokens": wl.output_tokens, "working_set_tokens": ws},
           "configs": results}
    if "off" in results and "on" in results:
        r_off, r_on = results["off"], results["on"]
        out["followup_ttft_p50_speedup"] = round(r_off["ttft_followup_p50_s"] / r_on["ttft_followup_p50_s"], 2)
        out["throughput_ratio_on_vs_off"] = round(r_on["output_tokens_per_s"] / r_off["output_tokens_per_s"], 3)
    if "stage" in results and "stage_full" in results and results["stage_full"].get("handoff_mb_per_turn"):
        out["stage_handoff_bytes_ratio"] = round(results["stage"]["handoff_mb_per_turn"]
                                                 / results["stage_full"]["handoff_mb_per_turn"], 3)
    if "alternate" in results and "alternate_node" in results:
        a, b = results["alternate"], results["alternate_node"]
        out["alternate_node_followup_ttft_p50_speedup"] = round(a["ttft_followup_p50_s"] / b["ttft_followup_p50_s"], 2)
        out["alternate_node_hit_rate"] = b["hit_rate"]
        out["alternate_hit_rate"] = a["hit_rate"]
    for name in ("on_small", "host", "host_disk"):
        if "on" in results and name in results and results["on"]["hit_rate"]:
            out[f"{name}_hit_rate_vs_ample"] = round(results[name]["hit_rate"] / results["on"]["hit_rate"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
