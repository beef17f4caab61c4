"""Profile a replica's engine steps with torch.profiler, for hosts where a step's host time is
the question (the GPU decode replica on the H200 held a whole core at ~37 ms a step for a
0.4B model: kernel launches, or something else?).

    KEYACC_PROFILE_STEPS=DIR[:SKIP[:COUNT]]   # in the replicas' environment (AppConfig.replica_env)

skips SKIP steps (default 50), profiles the next COUNT (default 50) and writes
DIR/steps-<pid>.txt: steps, rows and wall time per step, kernel launches per step (CUDA), and
the ops by self CPU time. Off unless the variable is set; one file per replica process.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "KEYACC_PROFILE_STEPS"


class StepProfiler:
    def __init__(self, out_dir: str, skip: int = 50, count: int = 50, label: str = ""):
        self.out = Path(out_dir) / f"steps-{os.getpid()}.txt"
        self.skip, self.count, self.label = skip, max(1, count), label
        self.seen = 0
        self.rows = 0
        self.wall = 0.0
        self._prof = None
        self.done = False

    @classmethod
    def from_env(cls, label: str = "") -> StepProfiler | None:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        parts = spec.split(":")
        nums = [int(p) for p in parts[1:3]]
        return cls(parts[0], *nums, label=label)

    def step(self, fn):
        """Run one engine step (fn), profiled when it falls in the window."""
        if self.done or self.seen < self.skip:
            self.seen += 1
            return fn()
        if self._prof is None:
            self._start()
        t = time.perf_counter()
        outputs = fn()
        self.wall += time.perf_counter() - t
        self.rows += len(outputs)
        self.seen += 1
        if self.seen >= self.skip + self.count:
            self._finish()
        return outputs

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()

    def _finish(self) -> None:
        self._prof.__exit__(None, None, None)
        self.done = True
        events = self._prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                              "cudaLaunchKernelExC"))
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        n = self.count
        try:  # a Ray worker's title names its replica (ray::ServeReplica:app:GpuDecode)
            import psutil

            title = " ".join(" ".join(psutil.Process().cmdline()).split())[:80]
        except Exception:  # noqa: BLE001 - only a label
            title = ""
        head = (f"{title} ({self.label}) pid {os.getpid()}: {n} steps profiled after {self.skip}\n"
                f"wall per step {self.wall / n * 1e3:.2f} ms, rows (tokens) per step {self.rows / n:.1f}, "
                f"aten ops per step {ops / n:.0f}, kernel launches per step {launches / n:.0f}\n\n")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(head + events.table(sort_by="self_cpu_time_total", row_limit=30))
        self._prof = None
