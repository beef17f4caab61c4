"""Load any OpenAI-compatible /v1/completions endpoint and print TTFT, TPOT, ITL, end-to-end
latency, throughput and goodput (and where tokens were decoded, for keyacc-ray servers).

    python -m keyacc_ray.bench --url http://127.0.0.1:8000 --model tiny-qwen3 --concurrency 8 --duration 30
    python -m keyacc_ray.bench --url ... --rate 4 --duration 60 --out results/poisson.json

Fixed output lengths use `ignore_eos` (a request extension keyacc-ray and vLLM accept). The last
line of output is the summary as one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from keyacc_ray.bench import loadgen
from keyacc_ray.bench.loadgen import Workload, closed_loop, open_loop, summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="the served model name")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop: clients sending back to back")
    mode.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--prompt-spread", type=float, default=0.0, help="uniform +-share around --prompt-tokens")
    ap.add_argument("--output-spread", type=float, default=0.0)
    ap.add_argument("--vocab-high", type=int, default=500, help="random prompt ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo-ms", type=float, default=2000)
    ap.add_argument("--tpot-slo-ms", type=float, default=150)
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--out", help="write the summary and every request's record as JSON here")
    args = ap.parse_args()

    if args.api_key:
        loadgen.HEADERS["Authorization"] = f"Bearer {args.api_key}"
    wl = Workload(args.prompt_tokens, args.output_tokens, args.prompt_spread, args.output_spread,
                  vocab_high=args.vocab_high, seed=args.seed)
    if args.concurrency:
        res, wall = asyncio.run(closed_loop(args.url, args.model, args.concurrency, args.duration, wl))
    else:
        res, wall = asyncio.run(open_loop(args.url, args.model, args.rate, args.duration, wl))
    s = summarize(res, wall, args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    s["mode"] = {"concurrency": args.concurrency} if args.concurrency else {"rate_per_s": args.rate}
    for k, v in s.items():
        print(f"{k:<20} {v}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "api_key"}, "summary": s,
                                              "requests": [r.__dict__ for r in res]}, indent=1))
    print(json.dumps(s))


if __name__ == "__main__":
    main()
