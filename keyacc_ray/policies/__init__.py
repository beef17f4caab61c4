"""Routing policies, pluggable by name: plain Python, no Ray, no torch, the clock injected."""
from __future__ import annotations

from keyacc_ray.policies.base import Policy, RequestView, ROUTES

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    _REGISTRY[cls.name] = cls
    return cls


def make_policy(name: str, options: dict | None = None, clock=None) -> Policy:
    from keyacc_ray.policies import gpu_only  # noqa: F401 - registers itself

    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](options or {}, clock=clock)


__all__ = ["Policy", "RequestView", "ROUTES", "make_policy", "register"]
