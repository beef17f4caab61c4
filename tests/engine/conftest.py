"""Engine-test fixtures."""
import pytest

from keyacc_ray import kernels
from keyacc_ray.engine.sampling import Sampler


@pytest.fixture(params=["torch", "kernel"])
def new_sampler(request):
    """A Sampler factory, once for the torch path (what CUDA runs) and once for the CPU kernel."""
    if request.param == "torch":
        return Sampler
    mod = kernels.load()
    assert mod is not None, f"kernels failed to build: {kernels.unavailable_reason()}"
    return lambda: Sampler(mod)
