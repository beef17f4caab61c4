"""The policy contract. A policy sees a `LoadView` (the monitor's snapshot plus the router's own
in-flight counts) and one request, and says where it runs: `route()` for the first hop,
`after_period()` after each CPU decode period."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

ROUTES = ("gpu", "cpu", "stage")
# route(): the request waits at the router (admitted nowhere yet) until a place frees on either
# pool, then is routed again; the router holds it (`Router.begin`).
HOLD = "hold"


@dataclass
class RequestView:
    """What a policy may know of a request."""

    num_prompt_tokens: int
    num_output_tokens: int  # generated so far
    max_tokens: int
    expected_output: int | None = None  # what requests here really generate (OutputLengths), if known
    held_s: float = 0.0  # how long the router has held it, not yet admitted anywhere (see HOLD)
    # prompt tokens at its head a CPU pool caches in any tier (its engines' news, else the router's
    # guess), and the seconds it would take that pool to load the part not in its block pool
    # (host, node or disk tier, at the bandwidth its engines measured; 0: all of it there, or not known)
    cpu_cached_tokens: int = 0
    cpu_cached_load_s: float = 0.0

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_output_tokens

    @property
    def total_tokens(self) -> int:
        """The KV this request is expected to take: prompt + every token it may generate, or, once
        the router knows what requests really generate, no more than that (a client that leaves
        max_tokens out asks for the whole context and, typically, uses a fraction of it; engines
        with lazy KV blocks only take what a sequence holds)."""
        out = self.max_tokens
        if self.expected_output is not None:
            out = max(self.num_output_tokens, min(self.max_tokens, self.expected_output))
        return self.num_prompt_tokens + out


class OutputLengths:
    """Output lengths of recently finished requests; `expected()` is a high quantile of them,
    None until enough have finished. Plain Python; the router feeds it."""

    def __init__(self, window: int = 256, quantile: float = 0.9, min_samples: int = 16):
        self._seen: deque[int] = deque(maxlen=window)
        self.quantile = quantile
        self.min_samples = min_samples
        self._expected: int | None = None  # kept per finished request: read on every routing decision

    def observe(self, num_output_tokens: int) -> None:
        if num_output_tokens <= 0:
            return
        self._seen.append(num_output_tokens)
        if len(self._seen) >= self.min_samples:
            s = sorted(self._seen)
            self._expected = s[min(len(s) - 1, int(self.quantile * len(s)))]

    def expected(self) -> int | None:
        return self._expected


@dataclass
class PoolLoad:
    """One deployment's load as the router sees it."""

    queue: int = 0  # requests waiting for admission (monitor), or beyond the slots (router count)
    slots: int = 0  # requests it runs at once (sequence slots or, where it binds, the KV budget); 0: unknown
    inflight: int = 0  # requests the router has sent there that have not left it
    running: int = 0
    free_blocks: int = 0  # the most free KV blocks on one replica
    total_blocks: int = 0
    block_size: int = 16
    known: bool = False  # False until the monitor has heard from it
    tokens_per_s: float = 0.0  # what the pool produced lately (monitor); 0 = not known yet
    prefill_tokens_per_s: float = 0.0  # how fast a prompt goes through one replica lately; 0 = not known
    queue_bound: int = 0  # the most requests its replicas' queues hold (past it a new one is refused); 0 = not known

    def refuses_new(self) -> bool:
        """A new request sent here now would be refused: its queue is at its bound."""
        return 0 < self.queue_bound <= self.queue

    def drain_s(self, extra_queue: int = 0) -> float | None:
        """Rough seconds to work off this queue at the pool's recent rate (None: rate unknown).
        Both pools serve the same request mix, so comparing two pools' figures is fair."""
        return (self.queue + extra_queue) / self.tokens_per_s if self.tokens_per_s > 0 else None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass
class LoadView:
    gpu_prefill: PoolLoad = field(default_factory=PoolLoad)
    gpu_decode: PoolLoad = field(default_factory=PoolLoad)
    cpu: PoolLoad = field(default_factory=PoolLoad)
    gpu_mem_free_bytes: int | None = None  # pynvml, where a GPU exists (a monitor figure)
    colocated: bool = False  # one GPU engine serves both phases: gpu_prefill is gpu_decode's load

    @property
    def gpu_queue(self) -> int:
        return self.gpu_decode.queue if self.colocated else self.gpu_prefill.queue + self.gpu_decode.queue

    @property
    def gpu_entry(self) -> PoolLoad:
        """The GPU deployment a new request enters (colocated: the one GPU engine)."""
        return self.gpu_decode if self.colocated else self.gpu_prefill

    @property
    def gpu_inflight(self) -> int:
        """The router's requests on the GPU, prefill and decode (colocated: one engine's, once)."""
        return self.gpu_decode.inflight if self.colocated else self.gpu_prefill.inflight + self.gpu_decode.inflight


class Policy:
    name = "base"
    DEFAULTS: dict = {}  # every option a policy takes, with its default

    def __init__(self, options: dict, clock=None):
        self.clock = clock or time.monotonic
        unknown = set(options) - set(self.defaults())
        if unknown:
            raise ValueError(f"policy {self.name}: unknown options {sorted(unknown)}; known: {sorted(self.defaults())}")
        self.options = {**self.defaults(), **options}
        self.counters: dict[str, int] = {}

    @classmethod
    def defaults(cls) -> dict:
        return dict(cls.DEFAULTS)

    def count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def observe(self, load: LoadView) -> None:
        """Called with every new load view (even with no request in flight)."""

    def route(self, req: RequestView, load: LoadView) -> str:
        """The first hop: "gpu" (prefill + decode on the GPU pool), "cpu" (whole request on the
        CPU pool) or "stage" (prefill on the GPU pool, decode on the CPU pool); or HOLD: it would
        wait for a place on whichever pool it went to, so it waits at the router for the first
        place either pool frees (asked again then, with `req.held_s` grown)."""
        raise NotImplementedError

    def after_prefill(self, req: RequestView, load: LoadView) -> str:
        """After a GPU prefill (of a request routed "gpu"): where its decode runs, "gpu" or "cpu"."""
        return "gpu"

    def decides_after_prefill(self) -> bool:
        """Whether `after_prefill` may answer anything but "gpu": where one GPU engine serves both
        phases it is then asked once, after the first token; otherwise the request decodes on."""
        return type(self).after_prefill is not Policy.after_prefill

    def decode_period_tokens(self) -> int | None:
        """Tokens per CPU decode period (None: no periods, the decode never moves back)."""
        return self.options.get("decode_period_tokens")

    def after_period(self, req: RequestView, load: LoadView) -> str:
        """After a CPU decode period: "gpu" to move the decode back, "cpu" to go on."""
        return "cpu"

    def recall(self, waiting: list[RequestView], load: LoadView) -> int | None:
        """Requests queued on the CPU pool that have not started there (oldest first): how many
        of them start over on the GPU instead, now that it has room (0: none now; None: this
        policy never recalls, so the pools need not ask)."""
        return None

    def offload_on_preemption(self) -> bool:
        """A decode the GPU pool preempts (out of KV blocks) moves to the CPU pool with its KV
        instead of waiting there to be recomputed."""
        return True
