"""How much dearer an engine's step is beside the other pool's working engine than alone, read
from a real run's step trace (keyacc_ray/engine/step_trace.py): the simulator's
`PoolSpec.corun_factor`, fitted by scripts/simulate.py --validate. Plain Python."""
from __future__ import annotations

import bisect

from keyacc_ray.sim.steptime import StepTime


def busy_spans(steps: list[dict], gap_s: float = 0.2) -> list[tuple[float, float]]:
    """When an engine was working: its steps' [start, end], joined where less than `gap_s` apart."""
    spans: list[list[float]] = []
    for start, end in sorted((s["t"] - s["wall_s"], s["t"]) for s in steps):
        if spans and start - spans[-1][1] <= gap_s:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(a, b) for a, b in spans]


def corun_factor(mine: list[dict], other: list[dict], model: StepTime, min_steps: int = 50) -> dict:
    """How much more of its thread's CPU an engine's step takes, against what the profile says for
    its rows and tokens, while the other pool's engine works (the two engines and the serving
    stack then share the box's cores: caches, the memory bus, the stack's processes taking slices
    of the engine's core) than while it works alone. A step counts as beside the other engine
    where its midpoint falls in one of that engine's busy spans. Compared kind by kind (steps with
    the same decode rows, with prompt tokens or without), so that where the profile reads some row
    counts, or prompts, slow or fast, and one side has more of them, it does not weigh in: the mean
    over the steps beside the other engine of their kind's cpu_vs_model beside over alone. Only
    kinds with at least `min_steps` steps on each side: a kind seen alone only in a cell's last
    seconds, as its requests drain, is no sample of it (at 10, such kinds drew the CPU pool's
    factor to 1.000-1.011 in runs M and N, where 30, 50 or 100 give 1.034-1.043:
    docs/benchmarks.md). `factor` None where no kind has enough steps on both sides."""
    spans = busy_spans(other)
    starts = [a for a, _ in spans]
    by_kind: dict[tuple[int, bool, bool], list[float]] = {}  # (rows, prompt, beside) -> [cpu, model, steps]
    for s in mine:
        mid = s["t"] - s["wall_s"] / 2
        i = bisect.bisect_right(starts, mid) - 1
        side = by_kind.setdefault((s["rows"], s["prompt_tokens"] > 0, i >= 0 and mid <= spans[i][1]), [0.0, 0.0, 0])
        side[0] += s["cpu_s"]
        side[1] += model.seconds(s["prompt_tokens"], s["rows"], s["kv_tokens"], s["attn_pairs"])
        side[2] += 1
    num = den = 0.0
    for (rows, prompt, beside), (c, m, n) in by_kind.items():
        alone = by_kind.get((rows, prompt, False))
        if beside and n >= min_steps and alone and alone[2] >= min_steps and m and alone[1] and alone[0]:
            num += n * (c / m) / (alone[0] / alone[1])
            den += n
    steps = {b: sum(v[2] for (_, _, bb), v in by_kind.items() if bb == b) for b in (True, False)}
    return {"factor": round(num / den, 3) if den else None, "beside": steps[True], "alone": steps[False],
            "compared": int(den)}
