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
from ray.serve.exceptions import BackPressureError

from keyacc_ray.policies import LoadView, PoolLoad, RequestView, make_policy
from keyacc_ray.serve.messages import ErrorItem, GenerateRequest, Handoff, SegmentStart, TokenChunk, Trace
from keyacc_ray.serve.monitor import LoadMonitor
from keyacc_ray.serve.pools import MONITOR_NAME, MONITOR_NAMESPACE

log = logging.getLogger("ray.serve")
REFRESH_EVERY_S = 0.1
MAX_RECOVERIES = 2
# Where a request goes on when a replica dies under it (the dead one is being replaced).
FAILOVER = {"gpu_prefill": "cpu_decode", "gpu_decode": "cpu_decode", "cpu_decode": "gpu_decode"}


def _err(status: int, message: str, type_: str = "internal_error") -> ErrorItem:
    return ErrorItem(status, {"error": {"message": message, "type": type_, "param": None, "code": None}})


class Router:
    def __init__(self, gpu_prefill, gpu_decode, cpu_decode, policy: str = "gpu_only",
                 policy_options: dict | None = None, allow_route_pinning: bool = True,
                 cpu_deployments: list[str] | None = None):
        """cpu_decode: one handle, or a list (one CPU decode deployment per NUMA node, named in
        `cpu_deployments`): each is separate capacity and the router balances across them."""
        cpu_handles = cpu_decode if isinstance(cpu_decode, list) else [cpu_decode]
        cpu_names = cpu_deployments or ["CpuDecode"] * len(cpu_handles)
        self.cpu_keys = [f"cpu_decode/{i}" for i in range(len(cpu_handles))]
        self.hops = {"gpu_prefill": gpu_prefill, "gpu_decode": gpu_decode, **dict(zip(self.cpu_keys, cpu_handles))}
        self.deployment_of = {"gpu_prefill": "GpuPrefill", "gpu_decode": "GpuDecode",
                              **dict(zip(self.cpu_keys, cpu_names))}
        self.policy = make_policy(policy, policy_options)
        self.allow_pinning = allow_route_pinning
        self.inflight = {h: 0 for h in self.hops}  # this router's requests on each hop, right now
        self._pending_blocks = {h: 0 for h in self.hops}  # blocks sent there since the last snapshot
        self._policy_counted: dict[str, int] = {}
        self._cpu_loads: list[PoolLoad] = [PoolLoad() for _ in self.cpu_keys]
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
                self._pending_blocks = {h: 0 for h in self.hops}
                self.policy.observe(self.load_view())
                self._collect_policy_counters()
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

    def reconfigure(self, user_config: dict) -> None:
        """Serve user_config: switch the policy without restarting anything."""
        if user_config and "policy" in user_config:
            self.policy = make_policy(user_config["policy"], user_config.get("policy_options") or {})
            self._policy_counted = {}
            log.info("keyacc router: policy is now %s %s", self.policy.name, self.policy.options)

    def load_view(self) -> LoadView:
        """The monitor's snapshot, corrected by what this router knows right now: its requests
        in flight beyond a pool's slots count as queued, and blocks it just sent as taken."""
        views = self.snapshot.deployments if self.snapshot is not None else {}
        gpu = (self.snapshot.gpu or {}) if self.snapshot is not None else {}
        loads = {}
        for hop, dep in self.deployment_of.items():
            v = views.get(dep)
            if v is None:
                loads[hop] = PoolLoad(queue=self.inflight[hop], known=False)
                continue
            loads[hop] = PoolLoad(queue=max(v.num_waiting, self.inflight[hop] - v.max_num_seqs),
                                  running=v.num_running,
                                  free_blocks=max(0, v.max_free_blocks - self._pending_blocks[hop]),
                                  total_blocks=v.num_total_blocks, block_size=v.block_size, known=True,
                                  tokens_per_s=v.tokens_per_s)
        free = None
        if gpu.get("available"):
            free = min(g["mem_free_bytes"] for g in gpu["gpus"])
        cpus = [loads[k] for k in self.cpu_keys]
        cpu = PoolLoad(queue=sum(c.queue for c in cpus), running=sum(c.running for c in cpus),
                       free_blocks=max(c.free_blocks for c in cpus), total_blocks=sum(c.total_blocks for c in cpus),
                       block_size=cpus[0].block_size, known=any(c.known for c in cpus),
                       tokens_per_s=sum(c.tokens_per_s for c in cpus))
        self._cpu_loads = cpus
        return LoadView(loads["gpu_prefill"], loads["gpu_decode"], cpu, free)

    def _pick_cpu(self, prefer: str | None = None) -> str:
        """One CPU decode deployment (NUMA node): stay where the sequence is unless that one is
        queued, else the least loaded (running + queued, with this router's in-flight count)."""
        if len(self.cpu_keys) == 1:
            return self.cpu_keys[0]
        self.load_view()
        load = {k: max(c.running + c.queue, self.inflight[k]) for k, c in zip(self.cpu_keys, self._cpu_loads)}
        if prefer in load and dict(zip(self.cpu_keys, self._cpu_loads))[prefer].queue == 0:
            return prefer
        return min(self.cpu_keys, key=lambda k: (load[k], self.inflight[k]))

    def _collect_policy_counters(self) -> None:
        now = dict(self.policy.counters)
        for attr in ("gpu", "cpu", "decode", "prefill"):
            gate = getattr(self.policy, attr, None)
            if gate is not None and hasattr(gate, "flag"):
                now[f"offload_decisions_suppressed_total|gate={attr}"] = gate.flag.suppressed
                now[f"offload_switches_total|gate={attr}"] = gate.flag.flips
        for k, v in now.items():
            d = v - self._policy_counted.get(k, 0)
            if d:
                name = k if "|" in k else f"policy_{k}_total"
                self._count(name, d)
        self._policy_counted = now

    def _count(self, key: str, n: float = 1) -> None:
        self._counters[key] = self._counters.get(key, 0) + n

    # ---- requests ----------------------------------------------------------------------
    def _first_route(self, req: GenerateRequest, view: RequestView) -> tuple[str, str]:
        if req.route is not None:
            if not self.allow_pinning:
                raise PermissionError("route pinning is turned off on this server")
            return req.route, "pinned"
        return self.policy.route(view, self.load_view()), "policy"

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
        generated: list[int] = []  # every token streamed to the client so far
        emitted_chars = 0
        recoveries = 0
        backpressured = False
        if route == "cpu":
            hop, export_after = "cpu_decode", self._cpu_period(req)
        else:
            hop, export_after = "gpu_prefill", 1
        last_cpu = None
        while hop is not None:
            started = time.monotonic()
            if hop == "cpu_decode":  # the CPU pool: pick one of its deployments (NUMA nodes)
                hop = last_cpu = self._pick_cpu(prefer=last_cpu)
            handle = self.hops[hop]
            next_handoff = None
            cur = hop
            self.inflight[cur] += 1
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
                                generated.extend(it.token_ids)
                                emitted_chars += len(it.text)
                            out.append(it)
                    if out:
                        yield out
                    if any(isinstance(i, ErrorItem) for i in out):
                        return
            except BackPressureError:  # the pool's bounded queue is full: not a fault
                self._count(f"rejected_total|hop={cur.split('/')[0]}")
                if cur == "gpu_decode" and req.route is None and handoff is not None and not backpressured:
                    # prefilled, but the GPU decode pool is full: decode on the CPU pool instead
                    backpressured = True
                    self._count("moves_total|from=gpu,to=cpu,reason=backpressure")
                    hop, export_after, last_cpu = "cpu_decode", self._cpu_period(req), None
                    continue
                yield [_err(503, f"the {cur.split('/')[0]} pool is overloaded; retry later", "overloaded_error")]
                return
            except Exception as e:  # noqa: BLE001 - a replica died or the stream broke
                if recoveries >= MAX_RECOVERIES:
                    log.exception("hop %s of %s failed; giving up", hop, req.request_id)
                    yield [_err(503, f"the {hop} replica failed mid-request ({e.__class__.__name__}) "
                                     "and recovery failed", "unavailable")]
                    return
                # Go on elsewhere from what the client already has: prompt + tokens so far, no KV
                # (prefilled again there); greedy output stays exact.
                recoveries += 1
                log.warning("hop %s of %s failed (%s); continuing on %s after %d tokens", hop,
                            req.request_id, e.__class__.__name__, FAILOVER[hop.split("/")[0]], len(generated))
                self._count(f"recoveries_total|hop={hop.split('/')[0]}")
                if trace.segments:
                    trace.segments[-1]["failed"] = True
                handoff = Handoff(req.request_id, None, [], list(req.prompt_token_ids) + generated,
                                  len(req.prompt_token_ids), req.params, None, emitted_chars)
                hop = FAILOVER[hop.split("/")[0]]
                last_cpu = None
                export_after = self._cpu_period(req) if hop == "cpu_decode" else None
                if not generated:
                    handoff = None  # nothing streamed yet: start the request over there
                continue
            finally:
                self.inflight[cur] -= 1
            pool = "gpu" if hop.startswith("gpu") else "cpu"
            self._count(f"pool_seconds_total|pool={pool}", time.monotonic() - started)
            hop = hop.split("/")[0]
            if next_handoff is None:
                break  # finished
            handoff = next_handoff
            view = RequestView(handoff.num_prompt_tokens, handoff.num_output_tokens, max_tokens)
            prev = hop
            hop, export_after = self._next_hop(req, hop, view, route)
            if hop == "gpu_decode":
                self._pending_blocks[hop] += self.load_view().gpu_decode.blocks_for(view.total_tokens)
            src, dst = ("cpu" if prev == "cpu_decode" else "gpu"), ("cpu" if hop == "cpu_decode" else "gpu")
            if src != dst:
                reason = "pinned" if req.route else ("offload" if dst == "cpu" else "return")
                self._count(f"moves_total|from={src},to={dst},reason={reason}")
        yield [trace]

    def _cpu_period(self, req: GenerateRequest) -> int | None:
        if req.migrate_back_after is not None:
            return req.migrate_back_after
        return self.policy.decode_period_tokens()

    def _next_hop(self, req: GenerateRequest, prev: str, view: RequestView, route: str) -> tuple[str, int | None]:
        if prev == "gpu_prefill":  # the hand-off: decode on the GPU, or on the CPU
            if route == "stage" or (req.route is None and self.policy.after_prefill(view, self.load_view()) == "cpu"):
                return "cpu_decode", self._cpu_period(req)
            return "gpu_decode", None
        if prev == "cpu_decode":  # end of a CPU period
            if req.route is not None:  # pinned: migrate_back_after moves it back once
                return "gpu_decode", None
            if self.policy.after_period(view, self.load_view()) == "gpu":
                return "gpu_decode", None
            return "cpu_decode", self.policy.decode_period_tokens()
        raise AssertionError(f"no hop after {prev}")

    async def snapshot_dict(self) -> dict:
        self._ensure_refresher()
        snap = self.snapshot
        return {"snapshot": snap.to_dict() if snap is not None else None,
                "snapshot_age_s": self.snapshot_age_s, "policy": self.policy.name}
