"""The baseline: every request prefills and decodes on the GPU pool."""
from keyacc_ray.policies import register
from keyacc_ray.policies.base import Policy, RequestView


@register
class GpuOnly(Policy):
    name = "gpu_only"

    def route(self, req: RequestView, snapshot) -> str:
        return "gpu"

    def offload_on_preemption(self) -> bool:
        return False
