"""How long one engine step takes on a device: a model fitted from the project's own engine
profiles (scripts/sim_calibrate.py), or derived from a device's published figures for planning.

A fitted profile (`token_knots`) reads a step as the tokens it feeds through the model, prompt
tokens and decode rows alike (both go through the same linear layers), plus what only some of
them do:

    t = L(prompt tokens + decode rows) + b_decode x decode rows + b_prefill_attn x prompt attention pairs
        + b_kv x KV tokens read by the decode rows

`L` is piecewise linear through the step times measured at each decode batch (`token_knots`:
1..32 tokens, the fixed cost of a step included) and past the last knot goes on at `b_prefill` a
token (a prompt's linear layers); `b_decode` is what a decode row costs beyond its token
(sampling); a prompt chunk of n tokens over c cached ones attends n x c + n(n+1)/2 pairs. One line
through all the steps, the form before this one, does not fit a CPU: with one thread here a step of
1 row took 10 ms, 4 rows 17, 8 rows 22, 16 rows 25, 32 rows 32 (the kernels change shape with the
batch), and a line was 24% fast at 8 rows and 11% slow at 32, the batches the bench's GPU and CPU
pools run at; and a step that joins a 64-token prompt to 8 decode rows costs the prompt's step
plus 5 ms, not plus the 22 ms the rows take alone: the tokens share the step's fixed cost.

Without knots, the linear form (hand-written profiles, tests):

    t = b0 + b_prefill x prompt tokens + b_decode x decode rows + b_kv x KV tokens read (+ b_prefill_attn x pairs)

A profile derived from a device's published figures (`roofline`) has `b_weights` > 0 and takes
the roofline's form instead: a step reads the weights and the KV while it computes, so it takes
the longer of the two, not their sum (at small batches the bytes bind, at large ones the FLOPs):

    t = b0 + max(b_weights + b_kv x KV tokens read, b_prefill x prompt tokens + b_decode x decode rows)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from keyacc_ray.engine.step_trace import attention_pairs  # noqa: F401 - the sim's engine imports it from here

PROFILES = Path(__file__).with_name("profiles")


@dataclass
class StepTime:
    name: str
    b0: float  # seconds per step (linear and roofline forms)
    b_prefill: float  # seconds per prompt token (with knots: per token past the last knot)
    b_decode: float  # seconds per decode row (with knots: beyond its token's share of L)
    b_kv: float  # seconds per KV token read by a decode row
    source: str = ""  # where the figures come from (a command, a commit, a document)
    residuals: dict = field(default_factory=dict)  # the fit's relative errors per measured point
    b_weights: float = 0.0  # > 0: the roofline form (seconds to read the weights once)
    token_knots: list = field(default_factory=list)  # [[tokens, seconds], ...] ascending: L's knots
    b_prefill_attn: float = 0.0  # seconds per (prompt token, token it attends to) pair

    def seconds(self, prefill_tokens: int, decode_rows: int, kv_tokens: int, prefill_attn: int | None = None) -> float:
        """A step's seconds; `prefill_attn`: the prompt chunks' (token, token attended) pairs (None:
        one chunk of `prefill_tokens` with nothing cached before it)."""
        if prefill_attn is None:
            prefill_attn = attention_pairs(prefill_tokens)
        attention = self.b_prefill_attn * prefill_attn + self.b_kv * kv_tokens
        if self.token_knots:
            return self.tokens_s(prefill_tokens + decode_rows) + self.b_decode * decode_rows + attention
        compute = self.b_prefill * prefill_tokens + self.b_decode * decode_rows
        if self.b_weights > 0:
            return self.b0 + max(self.b_weights + self.b_kv * kv_tokens, compute)
        return self.b0 + compute + attention

    def tokens_s(self, tokens: int) -> float:
        """L: a step's seconds for `tokens` through the model, nothing attended (knots form)."""
        w, past = knot_weights([k for k, _ in self.token_knots], tokens)
        return sum(x * s for x, (_, s) in zip(w, self.token_knots)) + past * self.b_prefill

    def scaled(self, factor: float, name: str | None = None) -> "StepTime":
        """The same device `factor` times slower (factor < 1: faster)."""
        return StepTime(name or self.name, self.b0 * factor, self.b_prefill * factor, self.b_decode * factor,
                        self.b_kv * factor, f"{self.source} x {factor:g}", b_weights=self.b_weights * factor,
                        token_knots=[[k, s * factor] for k, s in self.token_knots],
                        b_prefill_attn=self.b_prefill_attn * factor)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, name_or_path: str) -> "StepTime":
        """A profile file: a path, or a name under keyacc_ray/sim/profiles/."""
        p = Path(name_or_path)
        if not p.exists():
            p = PROFILES / f"{name_or_path}.json"
        d = json.loads(p.read_text())
        return cls(**{k: d[k] for k in ("name", "b0", "b_prefill", "b_decode", "b_kv", "source", "residuals",
                                         "b_weights", "token_knots", "b_prefill_attn") if k in d})


def knot_weights(knots: list[int], x: float) -> tuple[list[float], float]:
    """For f piecewise linear through the knots (ascending; from (0, 0) below the first): weights,
    one per knot, and how far x lies past the last knot, such that f(x) = sum of weight x f(knot)
    + that distance x the slope past the last knot."""
    w = [0.0] * len(knots)
    lo_x, lo = 0, None  # the segment's left end: (0, 0) first
    for i, k in enumerate(knots):
        if x <= k:
            t = (x - lo_x) / (k - lo_x)
            w[i] = t
            if lo is not None:
                w[lo] = 1 - t
            return w, 0.0
        lo_x, lo = k, i
    w[-1] = 1.0
    return w, x - knots[-1]


def fit(points: list[dict], name: str = "profile", source: str = "") -> StepTime:
    """The knots form fitted to measured steps (dicts of prefill_tokens, decode_rows, kv_tokens,
    seconds; optionally prefill_attn, else one chunk of prefill_tokens over nothing cached):
    least squares on relative errors (each point weighted by 1 / its time). The knots are the token
    counts of the decode steps measured alone; L at each knot is free, the four scalars
    (b_prefill past the knots, b_decode, b_prefill_attn, b_kv) are kept non-negative by dropping
    the most negative until none is. The residuals (predicted / measured - 1) come with it."""
    import numpy as np

    def attn(p: dict) -> int:
        return p.get("prefill_attn", attention_pairs(p["prefill_tokens"]))

    knots = sorted({p["decode_rows"] for p in points if p["decode_rows"] > 0 and p["prefill_tokens"] == 0})
    if not knots:
        raise ValueError("no decode step measured alone: nothing to put the knots on")
    rows = []
    for p in points:
        w, past = knot_weights(knots, p["prefill_tokens"] + p["decode_rows"])
        rows.append([past, p["decode_rows"], attn(p), p["kv_tokens"]] + w)
    X, y = np.array(rows, dtype=float), np.array([p["seconds"] for p in points])
    wt = 1.0 / y
    active = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        sol, *_ = np.linalg.lstsq(X[:, active] * wt[:, None], y * wt, rcond=None)
        coef[active] = sol
        negative = [i for i in active if i < 4 and coef[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coef[i]))
    res = (X @ coef - y) / y
    c = [float(v) for v in coef]
    return StepTime(name, 0.0, c[0], c[1], c[3], source,
                    {f"p{p['prefill_tokens']}_r{p['decode_rows']}_kv{p['kv_tokens']}": round(float(r), 4)
                     for p, r in zip(points, res)},
                    token_knots=[[k, v] for k, v in zip(knots, c[4:])], b_prefill_attn=c[2])


def roofline(name: str, weight_bytes: float, params: float, mem_bw_bytes_s: float, flops: float,
             kv_bytes_per_token: float, bw_efficiency: float, flop_efficiency: float, fixed_s: float = 0.0,
             source: str = "") -> StepTime:
    """A step-time model from published figures (for planning hardware not measured here): a step
    reads the weights once and each decode row's KV (at the bandwidth an engine reaches:
    `bw_efficiency` of the peak) while it computes 2 x params FLOPs per token, prompt or decode
    (at `flop_efficiency` of the peak); it takes the longer of the two, plus `fixed_s` (launches,
    the host's share)."""
    bw, fl = mem_bw_bytes_s * bw_efficiency, flops * flop_efficiency
    per_token = 2 * params / fl
    return StepTime(name, fixed_s, per_token, per_token, kv_bytes_per_token / bw,
                    source or (f"roofline: {weight_bytes / 1e9:.1f} GB weights, {mem_bw_bytes_s / 1e9:.0f} GB/s x "
                               f"{bw_efficiency:g}, {flops / 1e12:.0f} TFLOP/s x {flop_efficiency:g}"),
                    b_weights=weight_bytes / bw)
