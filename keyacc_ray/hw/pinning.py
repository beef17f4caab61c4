"""Pin a whole process (every thread, not just the caller) to a set of CPUs.

`os.sched_setaffinity(0, cpus)` pins only the calling thread and threads it creates later;
Serve runs user code on a thread of its own, so every thread id in /proc/self/task is pinned.
Call it before torch starts its thread pool, so the pool inherits the mask."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def pin_process(cpus: list[int]) -> list[int]:
    """Returns the CPUs actually applied. The mask this process inherited does not limit the
    choice (a replica started by a driver that kept itself off the CPU pool's cores may still
    pin to them); CPUs the kernel refuses (offline, outside the cgroup) are dropped."""
    target = sorted(set(cpus))
    try:
        os.sched_setaffinity(0, target)
        target = sorted(os.sched_getaffinity(0))  # what the kernel applied (cgroup cpuset)
    except OSError:
        allowed = os.sched_getaffinity(0)
        usable = sorted(set(cpus) & allowed) or sorted(allowed)
        log.warning("CPUs %s are not all usable here; pinning to %s", target, usable)
        target = usable
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), target)
        except OSError:  # a thread that exited meanwhile
            pass
    return target


# The OS name of each engine replica's engine thread (EngineLoop's): `top -H`, py-spy and
# keyacc_ray/bench/cpu_account tell its CPU from the rest of the replica's by it
ENGINE_THREAD_NAME = "keyacc-engine"


def name_os_thread(name: str) -> bool:
    """Give the calling thread `name` in the OS as well (Linux: /proc/<pid>/task/<tid>/comm, 15
    bytes at most); Python's thread names stay inside Python. False where it cannot."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0) == 0  # PR_SET_NAME
    except (OSError, AttributeError):  # no libc prctl (not Linux)
        return False
