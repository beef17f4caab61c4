"""Decode-stage offload (mode 2, high concurrency and long sequences).

Prefill always runs on the GPU pool. At the hand-off after prefill, the decode goes to the CPU
pool while the GPU decode pool is overloaded (its queue above `gpu_queue_high` for
`trigger_window_s`; back below `gpu_queue_safe` for `return_window_s`) or when the request's KV
would not fit there now (the memory check, not debounced: it is a fact, not a trend), and only
where the CPU pool has a free place (else it decodes on the GPU: a stream moved to a full pool
waits mid-stream). Elastic pipeline: CPU decode runs in periods of `decode_period_tokens`; after
each, the decode moves back to the GPU if the pool accepts again, the memory check passes and it
has a free place.
"""
from keyacc_ray.policies import register
from keyacc_ray.policies.base import LoadView, Policy, RequestView
from keyacc_ray.policies.hysteresis import PoolGate, fits, gate, has_place, return_decision


def decode_placement(policy: Policy, gate: PoolGate, req: RequestView, load: LoadView) -> str:
    """Where a prefilled request decodes. It has streamed its first token: moved to a CPU pool with
    no free place, it would wait there in a queue mid-stream (the soak's longest stalls), so it
    moves only to a free place and otherwise decodes on where it is."""
    policy.observe(load)
    if not (gate.overloaded or (load.gpu_decode.known and not fits(req, load.gpu_decode))):
        return "gpu"
    if not has_place(load.cpu):
        policy.count("decode_kept_cpu_full")
        return "gpu"
    policy.count("decode_offloaded_load" if gate.overloaded else "decode_offloaded_memory")
    return "cpu"


DEFAULTS = {
    "gpu_queue_high": 1, "gpu_queue_safe": 1, "trigger_window_s": 0.5, "return_window_s": 2.0,
    "decode_period_tokens": 16,
}


@register
class StageOffload(Policy):
    name = "stage_offload"

    DEFAULTS = DEFAULTS

    def __init__(self, options: dict, clock=None):
        super().__init__(options, clock)
        self.decode = gate(self.options, "gpu")

    def observe(self, load: LoadView) -> None:
        self.decode.update(load.gpu_decode.queue, self.clock())

    def route(self, req: RequestView, load: LoadView) -> str:
        self.observe(load)
        return "gpu"  # prefill on the GPU; the decode is placed at the hand-off

    def after_prefill(self, req: RequestView, load: LoadView) -> str:
        return decode_placement(self, self.decode, req, load)

    def after_period(self, req: RequestView, load: LoadView) -> str:
        return return_decision(self, self.decode, req, load)
