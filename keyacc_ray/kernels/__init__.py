"""CPU decode kernels (C++, built from csrc/ by torch.utils.cpp_extension).

`load()` returns the compiled module, building it once per machine into a cache folder
(`KEYACC_KERNEL_CACHE`, default ~/.cache/keyacc_ray/kernels/<torch version>); `make install`
builds it ahead of time so a replica never compiles on its first request. When no compiler
is usable, `load()` returns None and the engine runs plain torch.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SRCS = [Path(__file__).parent / "csrc" / f for f in ("cpu_kernels.cpp", "sampling.cpp")]
_lock = threading.Lock()
_mod = None
_failed: str | None = None


def cache_dir() -> Path:
    import torch

    base = os.environ.get("KEYACC_KERNEL_CACHE") or Path.home() / ".cache" / "keyacc_ray" / "kernels"
    return Path(base) / f"torch-{torch.__version__}"


def _ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; the pip `ninja` package (a dependency)
    puts it next to this interpreter, which a venv's python run by path does not have on PATH."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([d for d in dirs if d not in path] + path)


def load(verbose: bool = False):
    """The compiled kernels, or None (with the reason logged once) when they cannot be built."""
    global _mod, _failed
    with _lock:
        if _mod is not None or _failed is not None:
            return _mod
        try:
            from torch.utils.cpp_extension import load as build

            _ninja_on_path()
            out = cache_dir()
            out.mkdir(parents=True, exist_ok=True)
            _mod = build(name="keyacc_cpu_kernels", sources=[str(f) for f in _SRCS], build_directory=str(out),
                         extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"],
                         verbose=verbose)
        except Exception as e:  # noqa: BLE001 - no compiler, no headers: plain torch it is
            _failed = f"{type(e).__name__}: {e}"
            log.warning("CPU fast-path kernels unavailable, using plain torch: %s", _failed)
        return _mod


def unavailable_reason() -> str | None:
    return _failed

