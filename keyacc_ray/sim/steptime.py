"""How long one engine step takes on a device: a linear model fitted from the project's own engine
profiles (scripts/sim_calibrate.py), or derived from a device's published figures for planning.

    t = b0 + b_prefill x prompt tokens fed + b_decode x decode rows + b_kv x KV tokens read

`b0` is the fixed cost of a step (launches, the weights read once per step at batch 1: a decode
step is memory-bound), `b_prefill` the compute per prompt token, `b_decode` the per-row cost of a
decode step (sampling, the row's share of the linear layers past the bandwidth bound), `b_kv`
attention over the cached tokens the decode rows read.

A profile derived from a device's published figures (`roofline`) has `b_weights` > 0 and takes
the roofline's form instead: a step reads the weights and the KV while it computes, so it takes
the longer of the two, not their sum (at small batches the bytes bind, at large ones the FLOPs):

    t = b0 + max(b_weights + b_kv x KV tokens read, b_prefill x prompt tokens + b_decode x decode rows)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILES = Path(__file__).with_name("profiles")


@dataclass
class StepTime:
    name: str
    b0: float  # seconds per step
    b_prefill: float  # seconds per prompt token
    b_decode: float  # seconds per decode row
    b_kv: float  # seconds per KV token read by a decode row
    source: str = ""  # where the figures come from (a command, a commit, a document)
    residuals: dict = field(default_factory=dict)  # the fit's relative errors per measured point
    b_weights: float = 0.0  # > 0: the roofline form (seconds to read the weights once)

    def seconds(self, prefill_tokens: int, decode_rows: int, kv_tokens: int) -> float:
        compute = self.b_prefill * prefill_tokens + self.b_decode * decode_rows
        if self.b_weights > 0:
            return self.b0 + max(self.b_weights + self.b_kv * kv_tokens, compute)
        return self.b0 + compute + self.b_kv * kv_tokens

    def scaled(self, factor: float, name: str | None = None) -> "StepTime":
        """The same device `factor` times slower (factor < 1: faster)."""
        return StepTime(name or self.name, self.b0 * factor, self.b_prefill * factor, self.b_decode * factor,
                        self.b_kv * factor, f"{self.source} x {factor:g}", b_weights=self.b_weights * factor)

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
                                         "b_weights") if k in d})


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
