#!/usr/bin/env python3
"""lm-evaluation-harness's own client against a running server, checked against transformers.

Runs loglikelihood requests (lm-eval's `local-completions`: echo + logprobs, max_tokens 1) and one
generate_until request, and compares them with the same model run by transformers here. The
client finds the server's tokenizer endpoints by itself (`tokenizer_backend=auto`).

    pip install 'lm-eval[api]'     # not a dependency of keyacc-ray
    python scripts/lm_eval_check.py --url http://127.0.0.1:8000 --model tiny-qwen3 --model-path models/tiny-qwen3
"""
from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PAIRS = [("The capital of France is", " Paris"), ("def f(x):", "\n    return x"), ("1 + 1 =", " 2"),
         ("Once upon a time", " there was a princess who lived in a castle")]


def reference(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's loglikelihood of `continuation` after `context`, computed by transformers."""
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else tok(continuation, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ctx + cont])).logits[0].float(), -1)
    rows = lp[len(ctx) - 1:len(ctx) - 1 + len(cont)]
    picked = rows.gather(1, torch.tensor(cont)[:, None])[:, 0]
    return float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(cont)).all())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny-qwen3", help="the served model name")
    ap.add_argument("--model-path", default="models/tiny-qwen3", help="the same model, for transformers")
    ap.add_argument("--tolerance", type=float, default=1e-3)
    args = ap.parse_args()
    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.openai_completions import LocalCompletionsAPI
    except ImportError:
        sys.exit("needs lm-evaluation-harness: pip install 'lm-eval[api]'")
    lm = LocalCompletionsAPI(base_url=f"{args.url}/v1/completions", model=args.model, tokenizer=args.model_path,
                             num_concurrent=4, max_retries=1)
    print(f"lm-eval tokenizer backend: {lm.tokenizer_backend}")
    tok = AutoTokenizer.from_pretrained(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)])
    worst, ok = 0.0, True
    for (c, x), (ll, greedy) in zip(PAIRS, got):
        ref, ref_greedy = reference(model, tok, c, x)
        worst = max(worst, abs(ll - ref))
        ok &= greedy == ref_greedy
        print(f"{c!r} + {x!r}: server {ll:.5f} (greedy {greedy}), transformers {ref:.5f} (greedy {ref_greedy})")
    prompt = "The quick brown fox"
    gen = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": ["\n\n"], "max_gen_toks": 12}), 0)])[0]
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    ref_gen = tok.decode(out[0, len(ids):], skip_special_tokens=True).split("\n\n")[0]
    print(f"generate_until: server {gen!r}, transformers {ref_gen!r}")
    ok &= worst <= args.tolerance and gen == ref_gen
    print(f"max |loglikelihood difference| {worst:.2e}: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
