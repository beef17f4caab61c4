#!/usr/bin/env python3
"""Engine-level soak (no Ray, no HTTP): two engines shaped like the soak's two pools (`scripts/soak.py
--tiers`: "a" the emulated GPU pool, 8 places and 40 blocks with the growth reserve; "b" the CPU
pool, 16 places and 160 blocks; each lazy, with host and disk tiers and prefix caching) take
random greedy requests whose prompts share a few long heads (most to b, as at twice the
capacity), preempt under their block budgets, and hand sequences to each other: running ones
with and without the head the receiver is expected to cache left out of the package (as the
router asks, and one more block than it holds), waiting ones without KV, and half of a's
preempted ones with their KV (a colocated pool's `move_on_preempt`); some are aborted on the way.
Every completion is checked against transformers' generate(): equal, a float32 near-tie
(tests.helpers.float32_parting: generate()'s top logit within `--ulps` float32 spacings of the
engine's token there, and generate()'s own continuation after it), or wrong. A wrong one is
printed with its history in the engines (admissions, preemptions, tier loads, hand-offs) and the
run exits 1, as it does when a block is still held once idle. Last line: one JSON object with the figures.

    python scripts/stress_engine.py --requests 2000
    python scripts/stress_engine.py --requests 2000 --under-way 16 --seed 3
    python scripts/stress_engine.py --requests 2000 --no-tiers
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the quick brown fox jumps over a lazy dog while engines decode tokens on every core".split()


def make_engine(path: str, max_num_seqs: int, num_blocks: int, tiers: bool, caching: bool, under_way: int,
                disk_dir: str, block_bytes: int, **extra):
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine

    cfg = dict(model=path, dtype="float32", max_model_len=512, max_num_seqs=max_num_seqs, num_kv_blocks=num_blocks,
               enable_prefix_caching=caching, max_num_seqs_under_way=under_way, **extra)
    if tiers:
        cfg.update(kv_host_tier_gb=64 * block_bytes / 2**30, kv_disk_tier_gb=4096 * block_bytes / 2**30,
                   kv_disk_tier_dir=disk_dir)
    return LLMEngine(EngineConfig(**cfg))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--under-way", type=int, default=0, help="max_num_seqs_under_way of both engines")
    ap.add_argument("--no-tiers", action="store_true")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--handoff", type=float, default=0.15,
                    help="chance a running sequence moves from a to b, per step (b to a: a fifth of it)")
    ap.add_argument("--abort", type=float, default=0.002, help="chance a running request is aborted, per step")
    ap.add_argument("--b-share", type=float, default=0.9, help="share of new requests sent to engine b")
    ap.add_argument("--backlog", type=int, default=96, help="new requests wait while this many are queued")
    ap.add_argument("--ulps", type=int, default=None, help="the near-tie tolerance (default tests.helpers.TIE_ULPS)")
    args = ap.parse_args()
    stats, wrong = run(args.model, requests=args.requests, seed=args.seed, under_way=args.under_way,
                       tiers=not args.no_tiers, caching=not args.no_prefix_caching, handoff=args.handoff,
                       abort=args.abort, b_share=args.b_share, backlog=args.backlog, ulps=args.ulps)
    for w in wrong[:10]:
        print(json.dumps(w))
    print(json.dumps(stats))
    return 0 if not wrong and stats["blocks_free"] else 1


def run(model_path: str, requests: int = 300, seed: int = 0, under_way: int = 0, tiers: bool = True,
        caching: bool = True, handoff: float = 0.15, abort: float = 0.002, b_share: float = 0.9, backlog: int = 96,
        ulps: int | None = None, b_blocks: int = 160, b_seqs: int = 16,
        a_growth_reserve: bool = True) -> tuple[dict, list[dict]]:
    """The soak (see the module's doc); its figures, and each wrong completion with its history."""
    from keyacc_ray.engine.blocks import chain_hashes
    from keyacc_ray.engine.request import SamplingParams
    from tests.helpers import TIE_ULPS, float32_parting, hf_greedy, hf_model

    rng = random.Random(seed)
    ulps = TIE_ULPS if ulps is None else ulps
    model, tok = hf_model(model_path)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 16 * 4
    heads = [" ".join(r.choice(WORDS) for _ in range(120)) for r in (random.Random(i) for i in range(6))]
    tmp = tempfile.mkdtemp(prefix="keyacc-stress-")
    tiers = caching and tiers
    # the soak's pools: "gpu" 8 places, 40 blocks, growth reserve; "cpu" `b_seqs` places, `b_blocks` blocks
    engines = {"a": make_engine(model_path, 8, 40, tiers, caching, under_way, tmp, block_bytes,
                                kv_growth_reserve=a_growth_reserve),
               "b": make_engine(model_path, b_seqs, b_blocks, tiers, caching, under_way, tmp, block_bytes)}
    history: dict[str, list[str]] = defaultdict(list)  # request -> what happened to it
    outputs: dict[str, list[int]] = {}
    where: dict[str, str] = {}  # running request -> engine name
    prompts: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    most_running = {k: 0 for k in engines}

    # trace each engine's preemptions and admissions per request
    for name, eng in engines.items():
        sched = eng.scheduler
        real = sched.schedule

        def schedule(real=real, name=name, eng=eng):
            out = real()
            for s in out.preempted:
                history[s.request_id].append(f"{name}:preempted@{s.num_output_tokens}")
            for s in out.admitted:
                history[s.request_id].append(f"{name}:admitted@{s.num_output_tokens} cached={s.num_cached}")
            if eng.tiers is not None and eng.tiers.moves:
                loads = [m for m in eng.tiers.moves if m.dst == "device"]
                if loads:
                    for s in out.admitted:
                        history[s.request_id].append(f"{name}:step-with-{len(loads)}-tier-loads")
            return out

        sched.schedule = schedule

    sent = refused = handoffs = preempt_moves = 0
    steps = 0
    t0 = time.monotonic()
    while sent < requests or where:
        # arrivals: while fewer than --backlog wait, a few at a time, to either engine
        waiting = sum(e.scheduler.num_waiting for e in engines.values())
        while sent < requests and waiting < backlog and rng.random() < 0.7:
            waiting += 1
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
            if rng.random() < 0.8:
                text = rng.choice(heads) + " " + text
            ids = tok(text)["input_ids"]
            n = rng.randint(8, 64)
            rid = f"r{sent}"
            sent += 1
            name = "b" if rng.random() < b_share else "a"
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            if _seq(engines[name], rid, ids, params) is None:
                refused += 1
                continue
            prompts[rid], outputs[rid], where[rid] = (ids, n), [], name
            history[rid].append(f"{name}:added prompt={len(ids)} max_tokens={n}")
            if name == "a" and rng.random() < 0.5:  # preempted there, it leaves with its KV (a colocated pool's)
                engines[name].move_on_preempt[rid] = 0
        for name, eng in engines.items():
            if not eng.has_unfinished():
                continue
            most_running[name] = max(most_running[name], eng.scheduler.num_running)
            for o in eng.step():
                outputs[o.request_id] += o.new_token_ids
                if o.finished:
                    where.pop(o.request_id, None)
            steps += 1
            pkgs, eng.preempt_exports = eng.preempt_exports, []
            for pkg in pkgs:  # preempted with their KV: on to the other engine
                other = "b" if name == "a" else "a"
                engines[other].import_request(pkg)
                where[pkg.request_id] = other
                preempt_moves += 1
                history[pkg.request_id].append(f"{name}->{other}@{len(pkg.token_ids) - pkg.num_prompt_tokens} "
                                               f"preempted kv={pkg.meta.num_kv_tokens}")
        # hand-offs and aborts of running sequences
        for rid, name in list(where.items()):
            eng = engines[name]
            seq = eng.seqs.get(rid)
            if seq is None:
                continue
            r = rng.random()
            if r < abort and seq.num_output_tokens:
                eng.abort(rid)
                where.pop(rid)
                aborted.add(rid)
                continue
            # (mostly a -> b: the soak's GPU pool hands decodes to the CPU pool; b -> a a fifth as often)
            move = handoff if name == "a" else handoff / 5
            if r < abort + move and seq.num_output_tokens:  # (one waiting, preempted: a package without KV)
                other = "b" if name == "a" else "a"
                dst = engines[other]
                bs = dst.blocks.block_size
                hashes = chain_hashes([], seq.token_ids[:seq.num_prompt_tokens], bs)
                cached = dst.blocks.cached_prefix(hashes, len(hashes)) * bs if caching else 0
                skip = rng.choice([0, cached, cached + bs])  # (the last: more than it holds)
                pkg = eng.export_request(rid, skip_tokens=skip)
                dst.import_request(pkg)
                where[rid] = other
                handoffs += 1
                history[rid].append(f"{name}->{other}@{len(pkg.token_ids) - pkg.num_prompt_tokens} "
                                    f"skip={pkg.meta.kv_start} kv={pkg.meta.num_kv_tokens}")
    elapsed = time.monotonic() - t0
    stats = {"sent": sent, "checked": 0, "correct": 0, "near_tie": 0, "wrong": 0, "refused": refused,
             "aborted": len(aborted), "handoffs": handoffs, "preempt_moves": preempt_moves, "steps": steps,
             "seconds": round(elapsed, 1),
             "preemptions": {name: eng.scheduler.num_preemptions for name, eng in engines.items()},
             "most_running": most_running}
    wrong = []
    for rid, (ids, n) in prompts.items():
        if rid in aborted:
            continue
        got, want = outputs[rid], hf_greedy(model_path, ids, n)
        stats["checked"] += 1
        if got == want:
            stats["correct"] += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        part = float32_parting(model_path, ids, want, got, at, ulps) if len(got) == len(want) else None
        if part is not None and part["near_tie"]:
            stats["near_tie"] += 1
            continue
        stats["wrong"] += 1
        wrong.append({"request": rid, "prompt_tokens": len(ids), "max_tokens": n, "got": len(got),
                      "first_difference_at": at, **(part or {}), "history": history[rid]})
    for name, eng in engines.items():
        free = eng.blocks.num_free_blocks
        stats[f"{name}_blocks_free"] = f"{free}/{eng.blocks.num_blocks}"
        stats[f"{name}_tiers"] = (eng.stats().kv_tiers or {}).get("tiers")
    stats["blocks_free"] = all(e.blocks.num_free_blocks == e.blocks.num_blocks for e in engines.values())
    shutil.rmtree(tmp, ignore_errors=True)
    return stats, wrong


def _seq(eng, rid, ids, params):
    """A fresh sequence queued through the engine's own add_request; None where it was refused."""
    from keyacc_ray.errors import KeyaccError

    try:
        eng.add_request(rid, ids, params)
    except KeyaccError:  # a full queue: the request is not sent
        return None
    return eng.seqs[rid]


if __name__ == "__main__":
    sys.exit(main())
