"""The policy contract. A policy sees the load monitor's snapshot and one request, and says
where it runs: `route()` for the first hop, `after_period()` after each CPU decode period."""
from __future__ import annotations

import time
from dataclasses import dataclass

ROUTES = ("gpu", "cpu", "stage")


@dataclass
class RequestView:
    """What a policy may know of a request."""

    num_prompt_tokens: int
    num_output_tokens: int  # generated so far
    max_tokens: int

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_output_tokens

    @property
    def total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens


class Policy:
    name = "base"

    def __init__(self, options: dict, clock=None):
        self.clock = clock or time.monotonic
        unknown = set(options) - set(self.defaults())
        if unknown:
            raise ValueError(f"policy {self.name}: unknown options {sorted(unknown)}; known: {sorted(self.defaults())}")
        self.options = {**self.defaults(), **options}

    @classmethod
    def defaults(cls) -> dict:
        return {}

    def observe(self, snapshot) -> None:
        """Called with every new monitor snapshot (even with no request in flight)."""

    def route(self, req: RequestView, snapshot) -> str:
        """The first hop: "gpu" (prefill + decode on the GPU pool), "cpu" (whole request on the
        CPU pool) or "stage" (prefill on the GPU pool, decode on the CPU pool)."""
        raise NotImplementedError

    def decode_period_tokens(self) -> int | None:
        """Tokens per CPU decode period for staged requests (None: no periods, no return)."""
        return None

    def after_period(self, req: RequestView, snapshot) -> str:
        """After a CPU decode period: "gpu" to move the decode back, "cpu" to go on."""
        return "cpu"
