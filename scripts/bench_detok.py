#!/usr/bin/env python3
"""The detokenizer's cost per token as an output grows: one stream's `step_all` + `take` per
token, microseconds a token over successive stretches of a long output (an output whose cost per
token grows with its length shows it here).

    python scripts/bench_detok.py --model models/tiny-qwen3 --tokens 32000
    python scripts/bench_detok.py --stream     # no stop strings: stream_step, as the engine runs such a stream
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from keyacc_ray.engine.detok import IncrementalDetokenizer, step_all  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-qwen3")
    ap.add_argument("--tokens", type=int, default=32000)
    ap.add_argument("--stop", nargs="*", default=["</answer>"], help="the stream's stop strings")
    ap.add_argument("--stream", action="store_true", help="no stop strings, each token through stream_step")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    words = tok(" the quick brown fox jumps over the lazy dog,", add_special_tokens=False)["input_ids"]
    ids = (words * (args.tokens // len(words) + 1))[:args.tokens]
    marks = [m for m in (1000, 4000, 8000, 16000, 32000, 64000, 128000) if m < args.tokens] + [args.tokens]
    d = IncrementalDetokenizer(tok, [1, 2], [] if args.stream else args.stop)
    assert not args.stream or d.streams_bytes, "this tokenizer's decoding is not bytes: no stream_step"
    res, at, prev, t0 = {}, 0, 0, time.perf_counter()
    for k, t in enumerate(ids, 1):
        if args.stream:
            d.stream_step(t)
        else:
            step_all([d], [t])
            d.take(False)
        if k == marks[at]:
            t1 = time.perf_counter()
            res[f"us_per_token_{prev}_{k}"] = round((t1 - t0) / (k - prev) * 1e6, 2)
            prev, t0, at = k, t1, at + 1
    for k, v in res.items():
        print(f"{k:<28} {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
