#!/usr/bin/env python3
"""How far apart two correct float32 computations of the same next-token logits lie, in float32
spacings (ulps) at the top logit: transformers' generate() (one token a step over its KV cache)
against a full forward of the whole sequence, and this project's engine (prefix caching over
shared prompt heads, the CPU fast path, batched decode) against the same full forward. The
largest difference over the vocabulary at each step, p50 / p99 / max over the steps; and how many
steps had their two best logits closer than the rule's tolerance (where either token is right).

This is the scale of the near-tie rule (`tests.helpers.float32_parting`, the soaks): a
completion that parts from generate()'s where generate()'s own two best logits lie closer than
the spread of correct computations is a tie, not a defect.

    python scripts/logit_spread.py
    python scripts/logit_spread.py --model models/medium-qwen3 --prompts 30
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the quick brown fox jumps over a lazy dog while engines decode tokens on every core".split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import numpy as np
    import torch

    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.engine.request import SamplingParams
    from tests.helpers import TIE_ULPS, float32_spacing as ulp, hf_model

    model, tok = hf_model(args.model)
    rng = random.Random(args.seed)
    heads = [" ".join(r.choice(WORDS) for _ in range(120)) for r in (random.Random(i) for i in range(6))]
    prompts = []
    for _ in range(args.prompts):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
        prompts.append(tok(rng.choice(heads) + " " + text if rng.random() < 0.8 else text)["input_ids"])

    eng = LLMEngine(EngineConfig(model=args.model, dtype="float32", max_model_len=512, max_num_seqs=16))
    seen: dict[str, list] = {}
    real = eng.sampler.sample

    def sample(logits, rids, params, *a, **k):  # each row's logits as the engine samples them
        for i, r in enumerate(rids):
            seen.setdefault(r, []).append(logits[i].detach().float().clone())
        return real(logits, rids, params, *a, **k)

    eng.sampler.sample = sample
    outs = eng.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
    rids = sorted(seen, key=lambda r: int(r.rsplit("-", 1)[1]))

    spread = {"generate": [], "engine": []}
    close = 0  # steps whose two best logits (full forward) lie within the tolerance
    for p, out, rid in zip(prompts, outs, rids):
        ids = torch.tensor([p])
        with torch.inference_mode():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                               do_sample=False, eos_token_id=None, min_new_tokens=args.tokens, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            gen_out = g.sequences[0, len(p):].tolist()
            full_g = model(torch.tensor([p + gen_out])).logits[0].float()
            full_e = full_g if out == gen_out else model(torch.tensor([p + out])).logits[0].float()
        for j in range(args.tokens):
            ref = full_g[len(p) - 1 + j]
            top = float(ref.max())
            spread["generate"].append(float((g.logits[j][0].float() - ref).abs().max()) / ulp(top))
            two = torch.topk(ref, 2).values
            close += float(two[0] - two[1]) <= TIE_ULPS * ulp(top)
            ref = full_e[len(p) - 1 + j]
            spread["engine"].append(float((seen[rid][j] - ref).abs().max()) / ulp(float(ref.max())))
    report = {"model": args.model, "steps": len(spread["engine"]), "tolerance_ulps": TIE_ULPS,
              "steps_within_tolerance": close}
    for k, v in spread.items():
        a = np.array(v)
        report[f"{k}_vs_full_forward_ulps"] = {"p50": round(float(np.median(a)), 1),
                                               "p99": round(float(np.percentile(a, 99)), 1),
                                               "max": round(float(a.max()), 1)}
        print(f"{k:>8} vs a full forward: p50 {report[f'{k}_vs_full_forward_ulps']['p50']} "
              f"p99 {report[f'{k}_vs_full_forward_ulps']['p99']} max {report[f'{k}_vs_full_forward_ulps']['max']} "
              f"float32 spacings at the top logit")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
