"""Both mechanisms together. While the GPU accepts, requests run there. When the GPU decode
pool is overloaded but prefill keeps up, only the decode moves to the CPU at the hand-off
(stage offload, also when its KV would not fit the GPU decode pool now); when the whole GPU is
queued (prefill too), or flooded right now (beyond `gpu_queue_overflow` or one GPU decode batch),
whole requests go to the CPU (full offload's rule, `whole_request_route`). CPU decodes run in
periods and move back after the memory check, as in both modes."""
from keyacc_ray.policies import register
from keyacc_ray.policies.base import LoadView, Policy, RequestView
from keyacc_ray.policies.hysteresis import (check_whole_request_options, gate, recall_waiting, return_decision,
                                             whole_request_route)
from keyacc_ray.policies.stage_offload import decode_placement

DEFAULTS = {
    "gpu_queue_high": 2, "gpu_queue_safe": 1, "gpu_queue_overflow": 24, "prefill_queue_high": 2, "prefill_queue_safe": 1,
    "cpu_queue_high": 4, "cpu_queue_safe": 1, "trigger_window_s": 0.5, "return_window_s": 2.0,
    "decode_period_tokens": 16,
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
class Auto(Policy):
    name = "auto"

    DEFAULTS = DEFAULTS

    def __init__(self, options: dict, clock=None):
        super().__init__(options, clock)
        check_whole_request_options(self.options)
        self.gpu = gate(self.options, "gpu")
        self.prefill = gate(self.options, "prefill")
        self.cpu = gate(self.options, "cpu")

    def observe(self, load: LoadView) -> None:
        now = self.clock()
        self.gpu.update(load.gpu_queue, now)
        self.prefill.update(load.gpu_prefill.queue, now)
        self.cpu.update(load.cpu.queue, now)

    def route(self, req: RequestView, load: LoadView) -> str:
        self.observe(load)
        # whole-request offload when the whole GPU is queued; otherwise prefill on the GPU and
        # the decode is placed at the hand-off
        return whole_request_route(self, self.gpu.overloaded and self.prefill.overloaded, self.cpu, load, req)

    def after_prefill(self, req: RequestView, load: LoadView) -> str:
        return decode_placement(self, self.gpu, req, load)

    def after_period(self, req: RequestView, load: LoadView) -> str:
        return return_decision(self, self.gpu, req, load)

    def recall(self, waiting: list[RequestView], load: LoadView) -> int | None:
        self.observe(load)
        return recall_waiting(self, waiting, load)
