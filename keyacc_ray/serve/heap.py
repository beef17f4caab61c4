"""The heap a Serve replica holds once it is up, frozen out of Python's cyclic collector.

A replica's process holds hundreds of thousands of objects from its start (Ray, Serve, torch,
transformers, the tokenizer, the model's modules): about 400,000 in a pool replica. Python's
oldest-generation collection walks every one of them, 0.1-0.3 s on this project's 2-core
machines, with the GIL held: every stream of that replica stops for that long, and nothing of
the walk is ever garbage. `gc.freeze()` once the replica is built moves them to a permanent
generation the collector skips (vLLM freezes its engine core's startup heap the same way); what
is made later is collected as before.
"""
from __future__ import annotations

import gc
import logging
import sys
import time

log = logging.getLogger("ray.serve")  # (a replica's own log file)


def in_serve_replica() -> bool:
    serve = sys.modules.get("ray.serve")  # (not imported: not a replica; the simulator never imports it)
    if serve is None:
        return False
    try:
        serve.get_replica_context()
        return True
    except Exception:  # noqa: BLE001 - outside Serve (unit tests, scripts)
        return False


def freeze_startup_heap(name: str, force: bool = False) -> int:
    """Collect once, then freeze what is left (inside a Serve replica, or with `force`); returns
    how many objects were frozen (0: nothing done). Logs the full collection's time: about the
    pause every later full collection would have cost."""
    if not (force or in_serve_replica()):
        return 0
    t = time.perf_counter()
    gc.collect()
    spent = time.perf_counter() - t
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("keyacc %s: %d startup objects frozen out of the cyclic collector (a full collection "
             "of them took %.0f ms)", name, frozen, spent * 1e3)
    return frozen
