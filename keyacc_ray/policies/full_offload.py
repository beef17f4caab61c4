"""Whole-request offload (mode 1, light models and bursty load).

New requests go to the CPU pool while the GPU queue stays above `gpu_queue_high`; the GPU gets
new requests again only after its queue has stayed below `gpu_queue_safe` for `return_window_s`.
A flood is not a blip: while the GPU queue right now (the router's own in-flight count
included) exceeds `gpu_queue_overflow`, or one GPU decode batch (its slots, KV budget
included) where that is less, new requests overflow to the CPU at once, without waiting out
the trigger window (a burst of 40 requests arrives within milliseconds; waiting 0.5 s would
queue them all on the GPU, each behind whole request lifetimes there, while CPU slots idle).
The CPU pool is gated the same way. A request that would wait for a place on either pool
waits at the router (HOLD, up to `max_hold_s`) and takes the first place either frees. Held
that long, it has to queue somewhere: it goes to the pool that works off its queue sooner at its
recent rate (queue / tokens per second, both from the monitor), and to the GPU while either rate
is unknown.
Requests running on the CPU decode in periods of `decode_period_tokens`; after each, the decode
moves back to the GPU if the GPU is accepting again and the memory check passes, otherwise it
keeps running on the CPU.
"""
from keyacc_ray.policies import register
from keyacc_ray.policies.base import LoadView, Policy, RequestView
from keyacc_ray.policies.hysteresis import (check_whole_request_options, gate, recall_waiting, return_decision,
                                             whole_request_route)

DEFAULTS = {
    "gpu_queue_high": 2, "gpu_queue_safe": 1, "gpu_queue_overflow": 24, "cpu_queue_high": 4, "cpu_queue_safe": 1,
    "trigger_window_s": 0.5, "return_window_s": 2.0, "decode_period_tokens": 16,
    # requests queued on the CPU pool start over on the GPU when it has places first (off: on this
    # box's closed-loop bench it raised full_offload's p99 TTFT at 40 clients, docs/benchmarks.md)
    "recall_queued": False,
    # a request that would wait for a place on either pool waits at the router for the first one
    # (whole_request_route), up to this long; 0 (the default): it queues on a pool at once. On this
    # box's bench it cut full_offload's p99 TTFT at 40 clients with fixed output lengths (5.2 -> 2 s)
    # but raised p50 TTFT with spread ones (docs/benchmarks.md "Settings left off by default")
    "max_hold_s": 0.0,
    # a whole request goes to the CPU pool only if its prompt goes through there within this long
    # (prompt tokens / the pool's measured prefill rate); else it stays on the GPU (auto: prefill
    # there, the decode placed at the hand-off). 0: no limit. On a GPU box a CPU socket prefills a
    # 14B prompt at a few hundred tokens a second: sent whole, it missed a 2 s TTFT objective
    # (docs/planning.md)
    "cpu_prefill_max_s": 1.0,
    # places of the CPU pool new whole requests leave free for streams under way (preempted GPU
    # decodes, decodes placed after their prefill), which otherwise wait mid-stream for a place on
    # a full pool (scripts/soak.py --tiers: stalls of 7-9 s); 0: none kept
    "cpu_reserved_places": 0,
}


@register
class FullOffload(Policy):
    name = "full_offload"

    DEFAULTS = DEFAULTS

    def __init__(self, options: dict, clock=None):
        super().__init__(options, clock)
        check_whole_request_options(self.options)
        self.gpu = gate(self.options, "gpu")
        self.cpu = gate(self.options, "cpu")

    def observe(self, load: LoadView) -> None:
        now = self.clock()
        self.gpu.update(load.gpu_queue, now)
        self.cpu.update(load.cpu.queue, now)

    def route(self, req: RequestView, load: LoadView) -> str:
        self.observe(load)
        return whole_request_route(self, self.gpu.overloaded, self.cpu, load, req)

    def after_period(self, req: RequestView, load: LoadView) -> str:
        return return_decision(self, self.gpu, req, load)

    def recall(self, waiting: list[RequestView], load: LoadView) -> int | None:
        self.observe(load)
        return recall_waiting(self, waiting, load)
