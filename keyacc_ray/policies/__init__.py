"""Routing policies, pluggable by name: plain Python, no Ray, no torch, the clock injected."""
from __future__ import annotations

from keyacc_ray.policies.base import LoadView, PoolLoad, Policy, RequestView, ROUTES

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    _REGISTRY[cls.name] = cls
    return cls


def make_policy(name: str, options: dict | None = None, clock=None) -> Policy:
    from keyacc_ray.policies import auto, full_offload, gpu_only, stage_offload  # noqa: F401 - they register

    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](options or {}, clock=clock)


__all__ = ["LoadView", "PoolLoad", "Policy", "RequestView", "ROUTES", "make_policy", "register"]
