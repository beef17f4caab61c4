"""Debounced thresholds and the memory check shared by the offload policies.

A `Debounced` flag flips only after its condition has held for a whole window: a load that
crosses a threshold and falls back within the window (a square wave shorter than the window)
never flips it, and each such aborted episode is counted as a suppressed decision.
"""
from __future__ import annotations

from keyacc_ray.policies.base import HOLD, LoadView, Policy, PoolLoad, RequestView

# The most a request may wait at the router (`max_hold_s`): the ingress gives up on a router
# call after 10 s (serve/driver.py ROUTER_TIMEOUT_S) and would then decide alone.
MAX_HOLD_S = 5.0


def check_whole_request_options(options: dict) -> None:
    v = options["max_hold_s"]
    if not 0 <= v <= MAX_HOLD_S:
        raise ValueError(f"max_hold_s must be within [0, {MAX_HOLD_S}] seconds, got {v}")
    v = options["cpu_prefill_max_s"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError(f"cpu_prefill_max_s must be 0 (no limit) or more seconds, got {v!r}")
    r = options["cpu_reserved_places"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"cpu_reserved_places must be a whole number >= 0, got {r!r}")


class Debounced:
    def __init__(self, on_window_s: float, off_window_s: float, state: bool = False):
        self.on_window_s = on_window_s
        self.off_window_s = off_window_s
        self.state = state
        self._since: float | None = None
        self.flips = 0
        self.suppressed = 0

    def update(self, want_on: bool, want_off: bool, now: float) -> bool:
        """want_on: the condition to switch on holds now; want_off: the one to switch off."""
        pending = want_off if self.state else want_on
        window = self.off_window_s if self.state else self.on_window_s
        if not pending:
            if self._since is not None:
                self.suppressed += 1
            self._since = None
            return self.state
        if self._since is None:
            self._since = now
        if now - self._since >= window:
            self.state = not self.state
            self._since = None
            self.flips += 1
        return self.state


class PoolGate:
    """'Overloaded' state of one pool from its queue depth: on above `high` for `trigger_window_s`,
    off again only after below `safe` for `return_window_s`."""

    def __init__(self, high: int, safe: int, trigger_window_s: float, return_window_s: float):
        assert safe <= high, f"safe threshold {safe} must not exceed the high threshold {high}"
        self.high, self.safe = high, safe
        self.flag = Debounced(trigger_window_s, return_window_s)

    def update(self, queue: int, now: float) -> bool:
        return self.flag.update(queue > self.high, queue < self.safe, now)

    @property
    def overloaded(self) -> bool:
        return self.flag.state


def gate(options: dict, prefix: str) -> PoolGate:
    """The gate named by `<prefix>_queue_high` / `<prefix>_queue_safe` and the shared windows."""
    return PoolGate(options[f"{prefix}_queue_high"], options[f"{prefix}_queue_safe"],
                    options["trigger_window_s"], options["return_window_s"])


def fits(req: RequestView, pool: PoolLoad) -> bool:
    """The memory check before work moves onto a GPU replica: its engine's free KV blocks (the
    block pool is the memory: a paged engine preallocates it, so device free memory from pynvml
    does not move with load and says nothing here) hold the request's prompt plus all it may
    still generate."""
    return pool.known and pool.free_blocks >= pool.blocks_for(req.total_tokens)


def return_decision(policy: Policy, gate: PoolGate, req: RequestView, load: LoadView) -> str:
    """After a CPU decode period: back to the GPU only if its gate accepts again, the memory
    check passes and the GPU decode pool has a free place now (a stream moved to a full pool
    waits mid-stream); otherwise the decode keeps running on the CPU."""
    policy.observe(load)
    if gate.overloaded:
        return "cpu"
    if not fits(req, load.gpu_decode):
        policy.count("moves_refused_memory")
        return "cpu"
    if not has_place(load.gpu_decode):
        policy.count("moves_kept_gpu_full")
        return "cpu"
    return "gpu"


def has_place(pool: PoolLoad) -> bool:
    """A pool with a free place now: nothing queued, and (where its slots are known) fewer
    requests sent there than it runs at once."""
    return pool.queue == 0 and (not pool.slots or pool.inflight < pool.slots)


def gpu_batch(req: RequestView, load: LoadView) -> int | None:
    """How many requests like this one the GPU decode pool runs at once: its slots, or fewer
    where its KV budget binds (None: not known yet)."""
    dec = load.gpu_decode
    batch = dec.slots if dec.slots > 0 else None
    if dec.total_blocks > 0:
        kv = max(1, dec.total_blocks // dec.blocks_for(req.total_tokens))
        batch = kv if batch is None else min(batch, kv)
    return batch


def flooded(policy: Policy, req: RequestView, load: LoadView) -> bool:
    """More requests wait for the GPU right now than `gpu_queue_overflow`, or than one GPU decode
    batch where that is less (a request behind a whole batch waits a whole request's lifetime
    before it starts there). Waiting: the GPU's queues and, by this router's own counts, every
    request in prefill or decode beyond one batch (a prefilled request needs a decode slot next)."""
    batch = gpu_batch(req, load)
    limit = policy.options["gpu_queue_overflow"]
    waiting = load.gpu_queue
    if batch is not None:
        limit = min(limit, batch)
        waiting = max(waiting, load.gpu_inflight - batch)
    return waiting > limit


def gpu_places(policy: Policy, req: RequestView, load: LoadView) -> int:
    """How many requests like this one would start on the GPU at once if sent now: none while
    anything waits there or the memory check fails, else the places left in one decode batch
    (this router's requests in prefill and decode counted)."""
    batch = gpu_batch(req, load)
    if batch is None or load.gpu_queue > 0:
        return 0
    places = batch - load.gpu_inflight
    if places <= 0 or not fits(req, load.gpu_decode):
        return 0
    return places


def gpu_has_room(policy: Policy, req: RequestView, load: LoadView) -> bool:
    """Sent to the GPU now, the request would start at once (see `gpu_places`)."""
    return gpu_places(policy, req, load) > 0


def recall_waiting(policy: Policy, waiting: list[RequestView], load: LoadView) -> int | None:
    """Requests waiting for a CPU slot start over on the GPU where it has places for them now
    (the GPU freed up before the CPU pool did): as many as it has places, oldest first."""
    if not policy.options.get("recall_queued"):
        return None
    if not waiting:
        return 0
    n = min(len(waiting), gpu_places(policy, waiting[0], load))
    for _ in range(n):
        policy.count("recalled_from_cpu_queue")
    return n


def cpu_full(load: LoadView) -> bool:
    """Sent to the CPU pool now, the request would wait for a slot."""
    return load.cpu.queue > 0 or 0 < load.cpu.slots <= load.cpu.inflight


def cpu_place_for_new(policy: Policy, load: LoadView) -> bool:
    """The CPU pool has a place for a new request beyond the `cpu_reserved_places` it keeps for
    streams under way (a GPU decode preempted out of KV, a decode placed after its prefill): a
    stream moved to a pool with no free place waits, mid-stream, until one frees. True when
    nothing is reserved or the pool's slots are not known yet."""
    reserved, cpu = policy.options.get("cpu_reserved_places") or 0, load.cpu
    return not reserved or cpu.slots <= 0 or cpu.inflight + cpu.queue + reserved < cpu.slots


def cpu_prefill_fits(policy: Policy, req: RequestView, load: LoadView) -> bool:
    """Sent whole to the CPU pool, the request's prompt would go through there within
    `cpu_prefill_max_s` at the pool's measured prefill rate (unknown rate, or 0: no limit): the
    prompt tokens it would compute there, past the head the pool caches, and the time to load
    the part of that head held in a lower tier (no longer than computing it: the engine
    computes it when that is cheaper)."""
    limit, rate = policy.options.get("cpu_prefill_max_s") or 0.0, load.cpu.prefill_tokens_per_s
    if not limit or rate <= 0:
        return True
    load_s = min(req.cpu_cached_load_s, req.cpu_cached_tokens / rate)
    return (req.num_prompt_tokens - req.cpu_cached_tokens) / rate + load_s <= limit


def whole_request_route(policy: Policy, gpu_overloaded: bool, cpu_gate: PoolGate, load: LoadView,
                        req: RequestView) -> str:
    """Where a new request runs, whole-request offload style. The GPU while it accepts; the CPU
    pool while the GPU is overloaded (its gate) or flooded right now (its queue, the router's
    in-flight count included, see `flooded`: a burst of 40 requests arrives within
    milliseconds, and waiting out the trigger window would queue them all on the GPU) - except
    that a request never queues on the CPU pool while the GPU has room for it right now (the
    gate keeps the GPU from being flooded, not from being used). When the CPU pool is
    overloaded too, the request queues where the queue drains sooner at the pool's recent rate
    (queue / tokens per second), and on the GPU while a rate is unknown.

    A request whose prompt the CPU pool would take longer than `cpu_prefill_max_s` to go through
    (at its measured prefill rate) is never sent there whole: it stays on the GPU; nor one that
    would take one of the `cpu_reserved_places` kept for streams under way (it waits at the router
    up to `max_hold_s`, else queues on the GPU).

    Except that a request that would wait for a place wherever it went (the CPU pool full, the
    GPU pool without room) waits at the router instead, for up to `max_hold_s` (HOLD): admitted
    to a pool's queue it would wait there for that pool's first free place, which, with
    requests of similar lengths, can be a whole CPU request lifetime while the GPU turns over
    several; held, it takes the first place either pool frees.

    And a pool whose waiting queue is at its bound (its replicas would refuse the request, a 503)
    is not chosen while the other's is not: the request queues there instead."""
    flood = flooded(policy, req, load)
    if not gpu_overloaded and not flood:
        return "gpu"
    if not cpu_prefill_fits(policy, req, load):
        policy.count("cpu_prefill_too_slow")
        return "gpu"
    if not cpu_place_for_new(policy, load):  # the CPU pool's last places are for streams under way
        policy.count("cpu_places_reserved")
        return HOLD if req.held_s < policy.options["max_hold_s"] else "gpu"
    full = cpu_full(load)
    if full and gpu_has_room(policy, req, load):
        policy.count("gpu_room_over_cpu_queue")
        return "gpu"
    if full and req.held_s < policy.options["max_hold_s"]:
        return HOLD
    cpu_refuses, gpu_refuses = load.cpu.refuses_new(), load.gpu_entry.refuses_new()
    if cpu_refuses != gpu_refuses:  # one pool's queue is at its bound (it would refuse: a 503)
        policy.count("queue_bound_to_gpu" if cpu_refuses else "queue_bound_to_cpu")
        return "gpu" if cpu_refuses else "cpu"
    if not cpu_gate.overloaded:
        if not gpu_overloaded:
            policy.count("overflow_to_cpu")
        return "cpu"
    gpu_tps = load.gpu_prefill.tokens_per_s + load.gpu_decode.tokens_per_s
    cpu_wait = load.cpu.drain_s()
    if gpu_tps > 0 and cpu_wait is not None and cpu_wait < load.gpu_queue / gpu_tps:
        policy.count("both_overloaded_to_cpu")
        return "cpu"
    return "gpu"
