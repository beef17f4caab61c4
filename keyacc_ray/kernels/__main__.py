"""`python -m keyacc_ray.kernels`: build the CPU kernels now (make install runs this)."""
from keyacc_ray import kernels

m = kernels.load(verbose=False)
if m is None:
    raise SystemExit(f"kernel build failed: {kernels.unavailable_reason()}")
print(f"keyacc CPU kernels ready in {kernels.cache_dir()}; linear kernel: {m.isa()}")
