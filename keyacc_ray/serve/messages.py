"""Typed messages that cross a process boundary between ingress, router and pools.

A pool's `generate` stream yields lists of these items: one `SegmentStart`, then `TokenChunk`s,
and at the end either a finished `TokenChunk`, a `Handoff` (the sequence stops here and goes
on elsewhere) or an `ErrorItem`. Nothing here is ever built from client bytes by unpickling:
the ingress parses JSON into `GenerateRequest`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams fields
    route: str | None = None  # pinned route: "gpu", "cpu" or "stage"
    migrate_back_after: int | None = None


@dataclass
class SegmentStart:
    pool: str  # "gpu" or "cpu"
    phase: str  # "prefill" or "decode"
    replica: str
    deployment: str
    node: str = ""  # the Ray node id the replica runs on


@dataclass
class TokenChunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class ErrorItem:
    status_code: int
    body: dict  # {"error": {...}} in OpenAI's shape


@dataclass
class Handoff:
    """A sequence's state between two engines. Only the K/V arrays go through the object store
    (`kv_ref`, a one-element list so the ref is passed along, not resolved); the small state
    travels inline, so if the KV object is lost the receiver can prefill prompt + tokens so far."""

    request_id: str
    meta: Any  # KVMeta
    kv_ref: list  # [ObjectRef of (keys, values)], or [] when there is no KV to pass
    token_ids: list[int]
    num_prompt_tokens: int
    params: dict
    rng_state: np.ndarray | None
    emitted_text_chars: int
    kv_bytes: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class Trace:
    """Where a request ran: the `keyacc` object of a response."""

    segments: list[dict] = field(default_factory=list)

    def start(self, s: SegmentStart) -> None:
        last = self.segments[-1] if self.segments else None
        if last and s.phase == "decode" and (last["replica"], last["deployment"]) == (s.replica, s.deployment):
            last["periods"] += 1  # the next decode period on the same replica: not a move
            return
        self.segments.append({"pool": s.pool, "phase": s.phase, "replica": s.replica,
                              "deployment": s.deployment, "node": s.node, "tokens": 0, "periods": 1})

    def add_tokens(self, n: int) -> None:
        if self.segments:
            self.segments[-1]["tokens"] += n

    def to_dict(self) -> dict:
        return {"segments": self.segments, "moves": max(0, len(self.segments) - 1)}
