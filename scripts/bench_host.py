#!/usr/bin/env python3
"""The engine's host work per decode step, and how many long sequences the paged KV holds.

- `host_ms_b{1,64,256}_{greedy,qwen3,topp,penalties}`: per decode step, everything but the model forward
  (scheduling, inputs, sampling, postprocessing, detokenization), at batch 1, 64 and 256 on the
  tiny model, with the engine's CPU kernels as a CPU replica runs them (`--kernels off`: plain
  torch): greedy; Qwen3's default sampling (temperature 0.6, top-k 20, top-p 0.95); top-p
  0.95 alone; Qwen2.5's (temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.05) with a
  presence penalty of 0.5 (`--modes` picks some). The model's own forward is timed by wrapping it (every version of the engine calls
  it), so the same script measures an older commit too. Median over the measured steps of three
  rounds, interleaved over the cases.
- `paged_seqs_ratio`: max_model_len 32768 and a KV budget of 65,536 tokens; sequences of 2,000
  tokens (1,990-token prompts, 10 new tokens); the most running at once while each holds at
  least 1,990 tokens, over 32 (what the budget holds for the tokens in use); the prompt-token
  budget per step is 65,536, so that admission is limited by memory alone.

    python scripts/bench_host.py --model models/tiny-qwen3      # prints a table, then one JSON line
    python scripts/bench_host.py --pieces 256                   # where a decode step's host time goes

`--pieces B`: instead, B rows decoding in each mode, each piece of a decode step timed on its own
(median ms over --steps x 3 steps): scheduling, the step's inputs (the engine's decode arrays and
`runner._decode_inputs`), the model (the fused step), sampling, postprocessing (of which
detokenization), and the rest of `LLMEngine.step`.
bench_engine.py runs the same functions and adds the keys to its JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from keyacc_ray.config import EngineConfig  # noqa: E402
from keyacc_ray.engine.llm_engine import LLMEngine  # noqa: E402
from keyacc_ray.engine.request import SamplingParams  # noqa: E402

MODES = {
    "greedy": dict(temperature=0.0),
    "qwen3": dict(temperature=0.6, top_k=20, top_p=0.95),
    "topp": dict(temperature=1.0, top_p=0.95),
    # Qwen2.5's generation config (temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.05)
    # and a presence penalty: the rows' logits adjusted before sampling
    "penalties": dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, presence_penalty=0.5),
}


def _time_forwards(runner) -> list[float]:
    """Time the model's own forward (the module call every version of the engine makes) and, where
    the CPU kernels' fused decode step replaces it, that step; returns the list their durations
    (s) are added to. Everything else in a step is host work: scheduling, building the inputs
    (ids, positions, block tables, masks), sampling, postprocessing, detokenization."""
    spent = [0.0]

    def wrap(fn):
        def timed(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            spent[0] += time.perf_counter() - t
            return out
        return timed

    runner.model.forward = wrap(runner.model.forward)
    if getattr(runner, "fused_step", None) is not None:
        runner._unwrapped_fused = runner.fused_step
        runner.fused_step = wrap(runner.fused_step)
    return spent


def _decoding(engine: LLMEngine, batch: int, mode: str, max_tokens: int, rng: random.Random) -> None:
    """`batch` new requests of 32-token prompts sampled by `mode`, every prompt prefilled."""
    vocab = engine.runner.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1, **MODES[mode])
    for _ in range(batch):
        engine.add_request(f"h{mode}{batch}-{rng.random()}", [rng.randrange(vocab) for _ in range(32)], params)
    while engine.scheduler.num_waiting or any(s.num_cached == 0 for s in engine.seqs.values()):
        engine.step()


def host_ms(engine: LLMEngine, batch: int, mode: str, steps: int, rng: random.Random) -> list[float]:
    """The host ms of each of `steps` decode steps of `batch` new requests sampled by `mode`."""
    spent = _time_forwards(engine.runner)
    try:
        _decoding(engine, batch, mode, steps + 8, rng)
        host = []
        for _ in range(steps):
            spent[0] = 0.0
            t = time.perf_counter()
            engine.step()
            host.append((time.perf_counter() - t - spent[0]) * 1e3)
    finally:
        for rid in list(engine.seqs):
            engine.abort(rid)
        _unwrap(engine.runner)
    return host


def _unwrap(runner) -> None:
    runner.model.__dict__.pop("forward", None)
    if getattr(runner, "_unwrapped_fused", None) is not None:
        runner.fused_step = runner._unwrapped_fused


def bench_host(model: str, steps: int = 20, dtype: str = "float32", kernels: str = "auto", rounds: int = 3,
               modes=tuple(MODES)) -> dict:
    """`kernels`: the engine's cpu_kernels, "auto" as a CPU replica runs it (its sampling goes
    through the C++ kernel where built; the fused decode step is model time, not host time).
    Each figure is the median over `rounds` x `steps` steps, the rounds interleaved over the
    cases (this VM's speed drifts by tens of percent over minutes: every case sees the same drift)."""
    rng = random.Random(0)
    eng = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=256, max_model_len=256,
                                 num_kv_blocks=256 * 64 // 16, cpu_kernels=kernels))
    got: dict[str, list[float]] = {}
    for _ in range(rounds):
        for b in (1, 64, 256):
            for mode in modes:
                got.setdefault(f"host_ms_b{b}_{mode}", []).extend(host_ms(eng, b, mode, steps, rng))
    return {k: round(statistics.median(v), 3) for k, v in got.items()}


def paged_seqs_ratio(model: str, dtype: str = "float32") -> dict:
    """See the module docstring. A copy of the model's config with a 32k context (the tiny models
    have 1024 positions; only the context limit changes)."""
    tmp = tempfile.mkdtemp(prefix="keyacc-paged-")
    try:
        for f in os.listdir(model):
            shutil.copy(os.path.join(model, f), tmp)
        cfg = json.load(open(os.path.join(tmp, "config.json")))
        cfg["max_position_embeddings"] = 32768
        json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
        # a prompt-token budget that admits every prompt that fits at once: the figure is what
        # the memory holds, not how fast prompts are let in
        eng = LLMEngine(EngineConfig(model=tmp, dtype=dtype, max_num_seqs=64, max_model_len=32768,
                                     num_kv_blocks=65536 // 16, cpu_kernels="off", max_prefill_tokens=65536))
        rng = random.Random(1)
        vocab = eng.runner.vocab_size
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        for i in range(40):
            eng.add_request(f"p{i}", [rng.randrange(vocab) for _ in range(1990)], params)
        most = 0
        while eng.has_unfinished():
            eng.step()
            full = sum(1 for s in eng.scheduler.running if s.num_cached >= 1990)
            most = max(most, full)
        return {"paged_seqs_at_once": most, "paged_seqs_ratio": round(most / 32, 3)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(res: dict) -> None:
    """A table, then the same figures as one JSON line (the line scripts read)."""
    width = max(map(len, res))
    for k, v in res.items():
        print(f"{k:<{width}}  {v}")
    print(json.dumps(res))


def host_pieces(model: str, batch: int, steps: int, kernels: str = "auto", modes=tuple(MODES)) -> dict:
    """Median ms of each piece of a decode step at `batch` rows, per sampling mode (see --pieces)."""
    import keyacc_ray.engine.llm_engine as le

    out = {}
    for mode in modes:
        eng = LLMEngine(EngineConfig(model=model, dtype="float32", max_num_seqs=batch, max_model_len=256,
                                     num_kv_blocks=batch * 64 // 16, cpu_kernels=kernels))
        _decoding(eng, batch, mode, 3 * steps + 16, random.Random(0))
        spent: dict[str, list[float]] = {}

        def timed(fn, key):
            def run(*a, **k):
                t = time.perf_counter()
                r = fn(*a, **k)
                spent.setdefault(key, []).append(time.perf_counter() - t)
                return r
            return run

        eng.scheduler.schedule = timed(eng.scheduler.schedule, "schedule")
        eng.runner.forward = timed(eng.runner.forward, "forward")
        if not hasattr(eng.runner, "decode"):  # (an older engine: decode rows as StepItems)
            eng.runner._decode_rows = timed(eng.runner._decode_rows, "inputs")
        else:  # decode rows as arrays (the engine's common step) or as StepItems, both through here
            eng.runner._decode_inputs = timed(eng.runner._decode_inputs, "inputs")
            eng.runner.decode = timed(eng.runner.decode, "forward")
            eng._decode_arrays = timed(eng._decode_arrays, "inputs_arrays")
        fused = eng.runner.fused_step is not None
        if fused:
            eng.runner.fused_step = timed(eng.runner.fused_step, "model")
        else:
            eng.runner.model.forward = timed(eng.runner.model.forward, "model")
        eng._sample = timed(eng._sample, "sample")
        eng._postprocess = timed(eng._postprocess, "postprocess")
        step_all = le.step_all
        le.step_all = timed(step_all, "detok")
        try:
            totals = []
            for _ in range(3 * steps):
                t = time.perf_counter()
                eng.step()
                totals.append(time.perf_counter() - t)
        finally:
            le.step_all = step_all
        med = {k: statistics.median(v) * 1e3 for k, v in spent.items()}
        step = statistics.median(totals) * 1e3
        inputs = med.get("inputs", 0.0)
        pieces = {"schedule": med["schedule"], "inputs": inputs + med.get("inputs_arrays", 0.0),
                  "forward_other": med["forward"] - med["model"] - inputs,
                  "sample": med["sample"], "postprocess": med["postprocess"], "of_which_detok": med["detok"]}
        pieces["step_other"] = (step - med["schedule"] - med["forward"] - med["sample"] - med["postprocess"]
                                - med.get("inputs_arrays", 0.0))
        pieces["host"] = step - med["model"]
        out.update({f"pieces_b{batch}_{mode}_{k}": round(v, 3) for k, v in pieces.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-qwen3")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-paged", action="store_true")
    ap.add_argument("--kernels", default="auto", choices=["auto", "off"], help="the engine's cpu_kernels")
    ap.add_argument("--pieces", type=int, metavar="B", help="time each piece of a decode step at B rows instead")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the sampling modes measured")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.pieces:
        report(host_pieces(args.model, args.pieces, args.steps, args.kernels, args.modes))
        return
    res = bench_host(args.model, args.steps, kernels=args.kernels, modes=args.modes)
    if not args.skip_paged:
        res.update(paged_seqs_ratio(args.model))
    report(res)


if __name__ == "__main__":
    main()
