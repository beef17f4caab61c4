"""keyacc-ray: a CPU+GPU LLM inference server on Ray Serve."""

__version__ = "0.1.0"
