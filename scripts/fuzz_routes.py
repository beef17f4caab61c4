#!/usr/bin/env python3
"""Random requests sent down every route at once (keyacc_ray/bench/route_fuzz.py): gpu, cpu,
stage, stage and cpu with a move back to the GPU, and once streamed; every answer must be the
same (text, token ids, finish reasons, logprobs, usage). Float32 models only for exact
equality (bf16 diverges at near-ties, the tie-aware rule).

    python scripts/fuzz_routes.py --launch --model models/tiny-qwen3 --cases 100
    python scripts/fuzz_routes.py --url http://127.0.0.1:8000 --cases 300 --seed 7
    python scripts/fuzz_routes.py --launch --api chat --cases 60     # conversations, tools, JSON

With --launch it starts the default graph on this box (deployments/app.yaml's pools) with the
given model and stops it after. Each mismatch is printed as one JSON line; the last line is one
JSON object with the counts. Exit status 1 if any answer differed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyacc_ray.bench import route_fuzz  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (route pinning allowed)")
    ap.add_argument("--launch", action="store_true", help="start the default graph here with --model")
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3"), help="its local path (for the vocabulary)")
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrent", type=int, default=3, help="cases at once (six requests each)")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 only")
    ap.add_argument("--unpinned", type=int, default=0, help="copies of each case sent with no pin (the policy's route)")
    ap.add_argument("--api", choices=["completions", "chat", "both"], default="completions",
                    help="chat: conversations with tools, response formats and top logprobs (a chat template needed)")
    ap.add_argument("--port", type=int, default=8051)
    args = ap.parse_args()
    if not args.url and not args.launch:
        ap.error("--url or --launch")
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    url = args.url
    if args.launch:
        import yaml

        sys.path.insert(0, str(ROOT / "scripts"))
        from bench import serve_app

        cfg = yaml.safe_load((ROOT / "deployments" / "app.yaml").read_text())["applications"][0]["args"]
        cfg.update(model=str(Path(args.model).resolve()), allow_route_pinning=True)
        url = serve_app(cfg, args.port, 2)
    try:
        import httpx

        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        rep = route_fuzz.run(url, model, vocab, args.cases, args.seed, args.concurrent, args.greedy, log=print,
                              unpinned=args.unpinned, api=args.api)
    finally:
        if args.launch:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    print(json.dumps({"cases": rep.cases, "requests": rep.requests, "refused_everywhere": rep.errors,
                      "mismatches": len(rep.mismatches), "seed": args.seed, "api": args.api, "model": args.model}))
    return 1 if rep.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
