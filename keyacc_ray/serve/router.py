"""The router: picks the pool for each request and each phase, and chains the phases.

It reads a cached monitor snapshot, refreshed by a background task (never a blocking call on
the request path; if the monitor is gone it keeps its last snapshot), asks the policy, and
walks the request through its hops: GPU prefill -> (hand-off) -> GPU or CPU decode, with
CPU decode in periods after which the policy may move the decode back. Tokens stream up as they
come; the `Trace` of the segments goes out last.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray import serve

from keyacc_ray.policies import RequestView, make_policy
from keyacc_ray.serve.messages import ErrorItem, GenerateRequest, Handoff, SegmentStart, TokenChunk, Trace
from keyacc_ray.serve.monitor import LoadMonitor
from keyacc_ray.serve.pools import MONITOR_NAME, MONITOR_NAMESPACE

log = logging.getLogger("ray.serve")
REFRESH_EVERY_S = 0.1


def _err(status: int, message: str, type_: str = "internal_error") -> ErrorItem:
    return ErrorItem(status, {"error": {"message": message, "type": type_, "param": None, "code": None}})


class Router:
    def __init__(self, gpu_prefill, gpu_decode, cpu_decode, policy: str = "gpu_only",
                 policy_options: dict | None = None, allow_route_pinning: bool = True):
        self.hops = {"gpu_prefill": gpu_prefill, "gpu_decode": gpu_decode, "cpu_decode": cpu_decode}
        self.policy = make_policy(policy, policy_options)
        self.allow_pinning = allow_route_pinning
        self.snapshot = None
        self.snapshot_age_s = float("inf")
        self._counters: dict[str, float] = {}
        self._refresher: asyncio.Task | None = None
        self.monitor = ray.remote(LoadMonitor).options(
            name=MONITOR_NAME, namespace=MONITOR_NAMESPACE, get_if_exists=True, lifetime="detached",
            max_restarts=-1, num_cpus=0).remote()

    # ---- monitor snapshot --------------------------------------------------------------
    def _ensure_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        last_ok = time.monotonic()
        while True:
            try:
                snap = await asyncio.wait_for(self.monitor.snapshot.remote(), timeout=2.0)
                self.snapshot, last_ok = snap, time.monotonic()
                self.policy.observe(snap)
                if self._counters:
                    deltas, self._counters = self._counters, {}
                    self.monitor.add_counters.remote(deltas)
            except Exception:  # noqa: BLE001 - monitor restarting or gone: keep the last snapshot
                try:
                    self.monitor = ray.get_actor(MONITOR_NAME, namespace=MONITOR_NAMESPACE)
                except Exception:  # noqa: BLE001
                    pass
            self.snapshot_age_s = time.monotonic() - last_ok
            await asyncio.sleep(REFRESH_EVERY_S)

    def _count(self, key: str, n: float = 1) -> None:
        self._counters[key] = self._counters.get(key, 0) + n

    # ---- requests ----------------------------------------------------------------------
    def _first_route(self, req: GenerateRequest, view: RequestView) -> tuple[str, str]:
        if req.route is not None:
            if not self.allow_pinning:
                raise PermissionError("route pinning is turned off on this server")
            return req.route, "pinned"
        return self.policy.route(view, self.snapshot), "policy"

    async def generate(self, req: GenerateRequest):
        self._ensure_refresher()
        max_tokens = int(req.params.get("max_tokens", 16))
        view = RequestView(len(req.prompt_token_ids), 0, max_tokens)
        try:
            route, why = self._first_route(req, view)
        except PermissionError as e:
            yield [_err(403, str(e), "permission_error")]
            return
        self._count(f"requests_started_total|route={route},reason={why}")
        trace = Trace()
        handoff: Handoff | None = None
        if route == "cpu":
            hop, export_after = "cpu_decode", self._cpu_period(req)
        else:
            hop, export_after = "gpu_prefill", 1
        while hop is not None:
            started = time.monotonic()
            handle = self.hops[hop]
            next_handoff = None
            try:
                stream = handle.options(stream=True).generate.remote(req, handoff, export_after)
                async for items in stream:
                    out = []
                    for it in items:
                        if isinstance(it, SegmentStart):
                            trace.start(it)
                        elif isinstance(it, Handoff):
                            next_handoff = it
                        else:
                            if isinstance(it, TokenChunk):
                                trace.add_tokens(len(it.token_ids))
                            out.append(it)
                    if out:
                        yield out
                    if any(isinstance(i, ErrorItem) for i in out):
                        return
            except Exception as e:  # noqa: BLE001 - a replica died or the stream broke
                log.exception("hop %s of %s failed", hop, req.request_id)
                yield [_err(503, f"the {hop} replica failed mid-request: {e.__class__.__name__}", "unavailable")]
                return
            pool = "gpu" if hop.startswith("gpu") else "cpu"
            self._count(f"pool_seconds_total|pool={pool}", time.monotonic() - started)
            if next_handoff is None:
                break  # finished
            handoff = next_handoff
            view = RequestView(handoff.num_prompt_tokens, handoff.num_output_tokens, max_tokens)
            hop, export_after = self._next_hop(req, hop, view, route)
            src = "gpu" if handle is not self.hops["cpu_decode"] else "cpu"
            dst = "gpu" if hop.startswith("gpu") else "cpu"
            if src != dst or hop == "gpu_decode":
                self._count(f"moves_total|from={src},to={dst},reason="
                            f"{'pinned' if req.route else 'policy'}")
        yield [trace]

    def _cpu_period(self, req: GenerateRequest) -> int | None:
        if req.migrate_back_after is not None:
            return req.migrate_back_after
        return self.policy.decode_period_tokens()

    def _next_hop(self, req: GenerateRequest, prev: str, view: RequestView, route: str) -> tuple[str, int | None]:
        if prev == "gpu_prefill":  # after prefill: decode on the GPU, or on the CPU for "stage"
            if route == "stage":
                return "cpu_decode", self._cpu_period(req)
            return "gpu_decode", None
        if prev == "cpu_decode":  # end of a CPU period
            if req.route is not None:  # pinned: migrate_back_after moves it back once
                return "gpu_decode", None
            if self.policy.after_period(view, self.snapshot) == "gpu":
                return "gpu_decode", None
            return "cpu_decode", self.policy.decode_period_tokens()
        raise AssertionError(f"no hop after {prev}")

    async def snapshot_dict(self) -> dict:
        self._ensure_refresher()
        snap = self.snapshot
        return {"snapshot": snap.to_dict() if snap is not None else None,
                "snapshot_age_s": self.snapshot_age_s, "policy": self.policy.name}
