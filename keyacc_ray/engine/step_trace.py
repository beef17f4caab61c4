"""A record of every engine step: what it held and what it took, for comparing a real engine
with the simulator's step model (keyacc_ray/sim/steptime.py) inside a running server.

    KEYACC_STEP_TRACE_DIR=DIR   # in the replicas' environment (AppConfig.replica_env;
                                # scripts/bench.py --trace-steps DIR sets it)

appends one JSON line per step to DIR/steps-<pid>.jsonl: its time, decode rows, prompt tokens,
KV tokens read, prompt attention pairs, sequences imported (hand-offs written into the KV
cache), wall seconds and the engine thread's CPU seconds (the difference: time off a core, or
waiting for the GIL). `scripts/step_trace_report.py` reads the files against a step profile.
Off unless the variable is set; one file per engine process.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV = "KEYACC_STEP_TRACE_DIR"


def attention_pairs(chunk: int, cached: int = 0) -> int:
    """The (token, token attended) pairs of a prompt chunk of `chunk` tokens over `cached` ones
    before it: each attends what is cached and the chunk's tokens up to itself (the simulator's
    step model, keyacc_ray/sim/steptime.py, prices them)."""
    return chunk * cached + chunk * (chunk + 1) // 2


class StepTrace:
    def __init__(self, out_dir: str):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(out_dir) / f"steps-{os.getpid()}.jsonl"
        self.pool: str | None = None  # the pool the engine serves ("gpu", "cpu"), where its replica said

    @classmethod
    def from_env(cls) -> StepTrace | None:
        d = os.environ.get(ENV)
        return cls(d) if d else None

    def step(self, sched, run):
        """Run one scheduled step (`run(sched)`) and record it."""
        rows = len(sched.decode)
        kv = sum(s.num_cached for s in sched.decode) + sum(s.num_cached for s, _ in sched.prefill)
        prompt = sum(n for _, n in sched.prefill)
        pairs = sum(attention_pairs(n, s.num_cached) for s, n in sched.prefill)
        imports = sum(1 for s in sched.admitted if s.imported is not None)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = run(sched)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        with open(self.path, "a") as f:
            f.write(json.dumps({"t": round(time.time(), 4), "rows": rows, "prompt_tokens": prompt, "kv_tokens": kv,
                                "attn_pairs": pairs, "imports": imports, "wall_s": round(wall, 6),
                                "cpu_s": round(cpu, 6), **({"pool": self.pool} if self.pool else {})}) + "\n")
        return out
