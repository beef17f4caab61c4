"""Hardware facts: NUMA topology, GPUs (pynvml), CPU load (psutil)."""
