"""Pin a whole process (every thread, not just the caller) to a set of CPUs.

`os.sched_setaffinity(0, cpus)` pins only the calling thread and threads it creates later;
Serve runs user code on a thread of its own, so every thread id in /proc/self/task is pinned.
Call it before torch starts its thread pool, so the pool inherits the mask."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def pin_process(cpus: list[int]) -> list[int]:
    """Returns the CPUs actually applied (those this process may use)."""
    allowed = os.sched_getaffinity(0)
    target = sorted(set(cpus) & allowed) or sorted(allowed)
    if set(cpus) - allowed:
        log.warning("CPUs %s are not available to this process; pinning to %s", sorted(set(cpus) - allowed), target)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), target)
        except OSError:  # a thread that exited meanwhile
            pass
    return target
