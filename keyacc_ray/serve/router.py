"""The router: decides where each request runs, phase by phase.

It reads a cached monitor snapshot, refreshed by a background task (never a blocking call on
the request path; if the monitor is gone it keeps its last snapshot), and asks the policy. The
ingress's `RequestDriver` walks each request through its hops and calls the router at each
turn: `begin` (the first hop), `advance` (after a hand-off, a full queue, a failure or a
recall: GPU prefill -> GPU or CPU decode, CPU decode in periods after which the policy may move
the decode back), `finish`; and a CPU pool asks `recall` which of its queued, unstarted requests
should start over on the GPU now that it has room. Tokens never pass through here: a few small
calls per request, not per token. The router counts each request on its current hop (in flight)
to correct the snapshot. A new request the policy finds no place for on either pool (HOLD) waits
in `begin`, admitted nowhere, until a place frees (`_release_held`, oldest first).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from keyacc_ray.policies import LoadView, PoolLoad, RequestView, make_policy
from keyacc_ray.policies.base import HOLD, OutputLengths
from keyacc_ray.policies.hysteresis import cpu_full, cpu_place_for_new, fits, gpu_has_room, has_place
from keyacc_ray.serve.aio import wait_at_most
from keyacc_ray.serve.driver import FAILOVER, MAX_RECOVERIES, MAX_STALLS, REFUSED_WAIT_S, error_item as _err
from keyacc_ray.serve.heap import freeze_startup_heap
from keyacc_ray.serve.messages import REPLICA_GONE_ERRORS, HopEnd, Ticket
from keyacc_ray.serve.monitor import MONITOR_NAME, MONITOR_NAMESPACE, LoadMonitor, mean_measured
from keyacc_ray.serve.prefix_affinity import PREFIX_BLOCK, TIER_ORDER, PoolPrefixes

log = logging.getLogger("ray.serve")
REFRESH_EVERY_S = 0.1
# Nothing in flight, held or recalled here: the snapshot is refreshed this seldom (an idle server's
# router and monitor then cost next to nothing), and at once when the next request comes (it is
# decided on the last snapshot meanwhile: an idle server's load has not moved, and the router's
# own in-flight counts correct it from the first request on).
REFRESH_IDLE_S = 2.0
FIRST_SNAPSHOT_WAIT_S = 1.0
ACTIVE_TTL_S = 1800.0  # a request not heard of for this long no longer counts as in flight
STALE_SNAPSHOT_S = 2.0  # a snapshot older than this says nothing about which replicas live
FINISHED_KEEP_S = 120.0  # how long a finished request's id is kept, to recognise a check that crossed its end
# A request recalled from a CPU queue counts on the GPU from the recall until its driver asks for
# its next hop (a few ms), so that new arrivals do not take the same places; if it never comes
# (it started on the CPU before it could leave), the count lapses after this long.
RECALL_HOLD_S = 2.0
# A hop its pool did not take within the driver's bound is fresher news than the monitor's
# snapshot, which shows a killed replica alive for STALE_AFTER_S: that hop's deployment counts as
# gone for every move there (a policy's too) until a hop ends there after running (it takes calls
# again), the snapshot shows a replica of it not seen at the stall (its replacement), or this long
# passed. (The kill soak: a policy move to a CPU pool whose replica had just died waited 17 s.)
# A hop that failed with its replica's actor gone (messages.REPLICA_GONE_ERRORS) is the same news.
# (The 2x kill soak: after a CPU replica was killed, the new requests the policy sent there waited
# 20 s in Serve's queue for the replacement, and past its 64 the rest got a 503, the GPU pool live.)
STALL_MEMORY_S = 30.0
# A pool replica whose last report (busy: every 0.2 s) is at most this old is alive: a stream under
# way whose hop there was not taken within the driver's bound waits on for it (`keep_waiting`)
# while the other pool would make it wait too.
LIVE_REPORT_S = 1.0
# A pool's engine that refused a request with its waiting queue full is fresher news than the
# snapshot (the replica reports every 0.2 s, the router refreshes every 0.1 s): that hop counts at
# its queue bound in the load view for this long, so the next new requests go where the policy
# would send them past a full queue instead of each being refused there first.
QUEUE_FULL_NEWS_S = 0.5
NODE_TIER = "node_tier/"  # PoolPrefixes' names for the nodes' shared KV tiers (not hops), + the tier's id


@dataclass
class _Held:
    """A new request the policy holds here until either pool has a place (policies HOLD)."""

    ticket: Ticket
    since: float
    admitted: asyncio.Future  # its ticket, entered on its first hop, once a place is found


async def _wait_at_most(event: asyncio.Event, timeout_s: float) -> None:
    """Until the event is set or `timeout_s` passed, keeping a cancellation that meets the event
    being set (serve/aio.py: the refresher would outlive its router; a cancelled `begin` would go
    on and count its request in flight)."""
    try:
        await wait_at_most(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass


def hop_keys(num_cpu_deployments: int) -> list[str]:
    """The hops a request can take: both GPU pools, and one key per CPU decode deployment."""
    return ["gpu_prefill", "gpu_decode"] + [f"cpu_decode/{i}" for i in range(num_cpu_deployments)]


class Router:
    def __init__(self, cpu_deployments: list[str] | None = None, policy: str = "gpu_only",
                 policy_options: dict | None = None, allow_route_pinning: bool = True, monitor=None,
                 colocated_gpu: bool = False, clock=None, kv_handoff_skip: bool = True):
        """cpu_deployments: the CPU decode deployments' names (one per NUMA node where there are
        several): each is separate capacity and the router balances across them. colocated_gpu:
        one GPU engine (GpuDecode) serves both phases of a GPU request, prefill included, and
        GpuPrefill gets nothing (README "One copy of the weights per GPU"). clock: the request
        path's and the policy's time (time.monotonic; the simulator's own time in keyacc_ray.sim).
        kv_handoff_skip: hand-offs leave out the head their next pool likely caches."""
        self.clock = clock or time.monotonic
        self.colocated = colocated_gpu
        cpu_names = cpu_deployments or ["CpuDecode"]
        self.cpu_keys = hop_keys(len(cpu_names))[2:]
        self.deployment_of = {"gpu_prefill": "GpuPrefill", "gpu_decode": "GpuDecode",
                              **dict(zip(self.cpu_keys, cpu_names))}
        self.policy = make_policy(policy, policy_options, clock=self.clock)
        self.allow_pinning = allow_route_pinning
        self.inflight = {h: 0 for h in self.deployment_of}  # requests on each hop, right now
        self._active: dict[str, tuple[str, float, int]] = {}  # request id -> (hop, since, tokens)
        self.inflight_tokens = {h: 0 for h in self.deployment_of}  # KV each hop's requests reserve (tokens)
        self._pending_blocks = {h: 0 for h in self.deployment_of}  # blocks sent there since the last snapshot
        self._recalled: dict[str, float] = {}  # request id -> when recall sent it to the GPU (not there yet)
        self._finished: dict[str, float] = {}  # request id -> when it finished, oldest first (FINISHED_KEEP_S)
        self._held: deque[_Held] = deque()  # new requests waiting here for a place, oldest first
        self._policy_counted: dict[str, int] = {}
        self.output_lengths = OutputLengths()  # what requests really generate: their KV estimate
        self.prefixes = PoolPrefixes(clock=self.clock)  # which hops likely cache a prompt's head
        # per hop, the node's shared KV tier (engine/node_tier.py) all of its replicas read and
        # write, where they report one and the same (the last snapshot's)
        self._node_tier: dict[str, str] = {}
        self._kv_place: tuple | None = None  # where this router is in the monitor's log of KV events
        self.kv_handoff_skip = kv_handoff_skip
        self._replicas_seen: dict[str, set] = {}  # deployment -> its replicas in the last snapshot
        self._stalled: dict[str, tuple[float, frozenset]] = {}  # hop -> (when a hop there stalled, its replicas then)
        self._queue_full: dict[str, float] = {}  # hop -> when its engine last refused a request, queue full
        self._dead: dict[str, set] = {}  # deployment -> its replicas a hop failed on with the actor gone
        self._cpu_loads: list[PoolLoad] = [PoolLoad() for _ in self.cpu_keys]
        self.snapshot = None
        self.snapshot_age_s = float("inf")
        self._snapshot_at = float("-inf")  # this router's clock when the snapshot held came
        self._counters: dict[str, float] = {}
        self._refresher: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None  # set by a request while the refresher idles
        self._refreshed: asyncio.Event | None = None  # set after the refresher's next snapshot
        self._monitor_by_name = monitor is None  # looked up by name: after a restart, look it up again
        if monitor is None:
            import ray  # (here: the simulator runs this class without Ray)

            monitor = ray.remote(LoadMonitor).options(
                name=MONITOR_NAME, namespace=MONITOR_NAMESPACE, get_if_exists=True, lifetime="detached",
                max_restarts=-1, num_cpus=0).remote()
        self.monitor = monitor
        freeze_startup_heap("router")

    # ---- monitor snapshot --------------------------------------------------------------
    def _ensure_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._first_try = asyncio.Event()
            self._wake = None
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())
        elif self._wake is not None:  # the refresher idles: refresh now, for the requests to come
            self._wake.set()

    async def _ready(self) -> None:
        """Before a decision: the refresher runs, and the first decisions wait (up to
        FIRST_SNAPSHOT_WAIT_S) for its first try, so that a burst arriving at a fresh router is not
        routed blind (no slots, no KV budget known: every request of it would go to the GPU)."""
        self._ensure_refresher()
        if self.snapshot is None and not self._first_try.is_set():
            await _wait_at_most(self._first_try, FIRST_SNAPSHOT_WAIT_S)

    async def _refresh_loop(self) -> None:
        last_ok = time.monotonic()
        while True:
            try:
                since = self.snapshot.version if self.snapshot is not None else None
                snap = await wait_at_most(self.monitor.snapshot.remote(since, self._kv_place), 2.0)
                last_ok = time.monotonic()
                self.take_snapshot(snap)
                if self._counters:
                    deltas, self._counters = self._counters, {}
                    self.monitor.add_counters.remote(deltas)
            except Exception:  # noqa: BLE001 - monitor restarting or gone: keep the last snapshot
                try:
                    import ray

                    if self._monitor_by_name and ray.is_initialized():
                        self.monitor = ray.get_actor(MONITOR_NAME, namespace=MONITOR_NAMESPACE)
                except Exception:  # noqa: BLE001
                    pass
            self.snapshot_age_s = time.monotonic() - last_ok
            self._first_try.set()
            if self._refreshed is not None:
                self._refreshed.set()
            self._release_held()  # places the new snapshot shows; holds that ran out
            if not self.idle():
                await asyncio.sleep(REFRESH_EVERY_S)
                continue
            self._wake = wake = asyncio.Event()
            try:
                await _wait_at_most(wake, REFRESH_IDLE_S)
            finally:
                self._wake = None

    def idle(self) -> bool:
        """Nothing in flight, held or recalled: no decision depends on a fresh snapshot now."""
        return not self._active and not self._held and not self._recalled

    def take_snapshot(self, snap) -> None:
        """The monitor's answer (None: nothing changed since the one held): the policy observes the
        load (the refresher calls this every REFRESH_EVERY_S; so does the simulator)."""
        if snap is not None:
            self.snapshot, self._snapshot_at = snap, self.clock()
            self._pending_blocks = {h: 0 for h in self.deployment_of}
            self._forget_gone_replicas(snap)
            self._take_kv_events(snap)
        self.policy.observe(self.load_view())
        self._collect_policy_counters()

    def _forget_gone_replicas(self, snap) -> None:
        """A replica gone from the snapshot (dead, or silent: its replacement caches nothing): what
        its pool was guessed to cache is forgotten."""
        now: dict[str, set] = {}
        tiers: dict[str, set] = {}
        for r in snap.replicas or ():
            now.setdefault(r.get("deployment"), set()).add(r.get("replica"))
            tiers.setdefault(r.get("deployment"), set()).add(r.get("node_tier", ""))
        self._node_tier = {hop: next(iter(tiers[dep])) for hop, dep in self.deployment_of.items()
                           if len(tiers.get(dep, ())) == 1}
        for hop, dep in self.deployment_of.items():
            if self._replicas_seen.get(dep, set()) - now.get(dep, set()):
                self.prefixes.forget(hop)
            self.prefixes.live(hop, now.get(dep, ()))
        for hop, (_, seen) in list(self._stalled.items()):
            if now.get(self.deployment_of[hop], set()) - seen:  # a replica that was not there: the replacement
                del self._stalled[hop]
        self._dead = {dep: dead & now.get(dep, set()) for dep, dead in self._dead.items()
                      if dead & now.get(dep, set())}  # (gone from the snapshot too: forgotten)
        self._replicas_seen = now

    def _take_kv_events(self, snap) -> None:
        """The engines' news of where they hold prompts' heads (engine/kv_events.py), into the
        prefix view; all of it forgotten where some was missed (guesses only, until they tell)."""
        if not getattr(snap, "kv_complete", True):
            self.prefixes.forget_told()
        self._kv_place = getattr(snap, "kv_log", None) or self._kv_place
        events = getattr(snap, "kv_events", None)
        if not events:
            return
        hop_of = {dep: hop for hop, dep in self.deployment_of.items()}
        by_replica: dict[tuple[str, str], list] = {}
        for dep, replica, key, tier in events:
            hop = hop_of.get(dep)
            if hop is not None:
                by_replica.setdefault((hop, replica), []).append((key, tier))
        for (hop, replica), news in by_replica.items():
            self.prefixes.observe(hop, replica, news)
            pool = "cpu" if hop.startswith("cpu") else "gpu"
            for tier in {tier for _, tier in news}:
                self._count(f"kv_events_total|pool={pool},tier={tier or 'gone'}",
                            sum(1 for _, t in news if t == tier))

    def reconfigure(self, user_config: dict) -> None:
        """Serve user_config: switch the policy without restarting anything."""
        if user_config and "policy" in user_config:
            self.policy = make_policy(user_config["policy"], user_config.get("policy_options") or {}, clock=self.clock)
            self._policy_counted = {}
            log.info("keyacc router: policy is now %s %s", self.policy.name, self.policy.options)
            self._release_held()  # the new policy may not hold at all

    def _slots(self, hop: str, v) -> int:
        """How many of this hop's requests its replicas run at once: their sequence slots, or
        fewer where the KV budget binds (every engine reserves prompt + max_tokens at admission;
        the size is the average of this router's requests in flight there)."""
        slots, n = v.max_num_seqs, self.inflight[hop]
        if n and v.replicas and v.num_total_blocks:
            per_request = max(1, math.ceil(self.inflight_tokens[hop] / n / v.block_size))
            slots = min(slots, v.replicas * (v.num_total_blocks // v.replicas // per_request))
        return slots

    def load_view(self) -> LoadView:
        """The monitor's snapshot, corrected by what this router knows right now: its requests
        in flight beyond a pool's slots count as queued, and blocks it just sent as taken."""
        views = self.snapshot.deployments if self.snapshot is not None else {}
        gpu = (self.snapshot.gpu or {}) if self.snapshot is not None else {}
        if self._recalled:  # recalls whose requests never arrived lapse
            now = self.clock()
            self._recalled = {r: t for r, t in self._recalled.items() if now - t < RECALL_HOLD_S}
        loads = {}
        first_gpu = "gpu_decode" if self.colocated else "gpu_prefill"
        for hop, dep in self.deployment_of.items():
            inflight = self.inflight[hop] + (len(self._recalled) if hop == first_gpu else 0)
            v = views.get(dep)
            if v is None:
                loads[hop] = PoolLoad(queue=inflight, inflight=inflight, known=False)
                continue
            slots = self._slots(hop, v)
            loads[hop] = PoolLoad(queue=max(v.num_waiting, inflight - slots), slots=slots,
                                  inflight=inflight,
                                  running=v.num_running,
                                  free_blocks=max(0, v.max_free_blocks - self._pending_blocks[hop]),
                                  total_blocks=v.num_total_blocks, block_size=v.block_size, known=True,
                                  tokens_per_s=v.tokens_per_s, prefill_tokens_per_s=v.prefill_tokens_per_s,
                                  queue_bound=v.max_waiting)
        if self._queue_full:
            self._mark_full_queues(loads)
        free = None
        if gpu.get("available"):
            free = min(g["mem_free_bytes"] for g in gpu["gpus"])
        cpus = [loads[k] for k in self.cpu_keys]
        cpu = PoolLoad(queue=sum(c.queue for c in cpus), slots=sum(c.slots for c in cpus),
                       inflight=sum(c.inflight for c in cpus),
                       running=sum(c.running for c in cpus),
                       free_blocks=max(c.free_blocks for c in cpus), total_blocks=sum(c.total_blocks for c in cpus),
                       block_size=cpus[0].block_size, known=any(c.known for c in cpus),
                       tokens_per_s=sum(c.tokens_per_s for c in cpus),
                       prefill_tokens_per_s=mean_measured([c.prefill_tokens_per_s for c in cpus]),
                       queue_bound=sum(c.queue_bound for c in cpus) if all(c.queue_bound for c in cpus) else 0)
        self._cpu_loads = cpus
        if self.colocated:  # the GPU engine's queue is its prefill queue too
            return LoadView(loads["gpu_decode"], loads["gpu_decode"], cpu, free, colocated=True)
        return LoadView(loads["gpu_prefill"], loads["gpu_decode"], cpu, free)

    def _mark_full_queues(self, loads: dict[str, PoolLoad]) -> None:
        """The hops whose engine refused a request with its queue full in the last
        QUEUE_FULL_NEWS_S: at their queue bound in the view, whatever the snapshot says."""
        now = self.clock()
        for hop, at in list(self._queue_full.items()):
            if now - at >= QUEUE_FULL_NEWS_S or hop not in loads:
                del self._queue_full[hop]
                continue
            pool = loads[hop]
            pool.queue = pool.queue_bound = max(pool.queue, pool.queue_bound, 1)

    def _pick_cpu(self, prefer: str | None = None) -> str:
        """One CPU decode deployment (NUMA node): stay where the sequence is (or go where its
        prompt's head is cached) unless that one is queued, else the least loaded (running +
        queued, with this router's in-flight count)."""
        if len(self.cpu_keys) == 1:
            return self.cpu_keys[0]
        self.load_view()
        pools = dict(zip(self.cpu_keys, self._cpu_loads))
        load = {k: max(c.running + c.queue, self.inflight[k]) for k, c in pools.items()}
        live = {k for k, c in pools.items() if c.known and not self._stalled_lately(k)}
        if prefer in pools and pools[prefer].queue == 0 and (prefer in live or not live):
            return prefer
        # a deployment the monitor has no live replica of last (its requests would wait in Serve's
        # queue for a replacement)
        return min(self.cpu_keys, key=lambda k: (bool(live) and k not in live, load[k], self.inflight[k]))

    def _caching_cpu(self, t: Ticket) -> str | None:
        """The CPU decode deployment (NUMA node) that likely caches the longest head of the
        request's prompt, if any does (several deployments: `_pick_cpu` prefers it while it has
        nothing queued)."""
        if len(self.cpu_keys) == 1 or not t.prefix_keys:
            return None
        n, key = max((self.prefixes.cached_tokens(t.prefix_keys, t.num_prompt_tokens, k), k) for k in self.cpu_keys)
        return key if n > 0 else None

    def _stall_seen(self, hop: str) -> None:
        """A hop there was not taken in time, or failed with its replica gone (STALL_MEMORY_S)."""
        self._stalled[hop] = (self.clock(), frozenset(self._replicas_seen.get(self.deployment_of[hop], ())))

    def _live_replicas(self, hop: str) -> int:
        """Replicas of `hop`'s deployment in the last snapshot that no hop has failed on with
        their actor gone since (a killed replica shows in the snapshot for STALE_AFTER_S more)."""
        dep = self.deployment_of[hop]
        return len(self._replicas_seen.get(dep, set()) - self._dead.get(dep, set()))

    def _replica_gone(self, hop: str, replica: str) -> None:
        """A hop failed with its replica's actor gone (`replica`: which one, "" if it failed
        before it started there). The pool is gone for moves (`_stall_seen`) only when no other
        live replica of it is known: one of a GPU deployment's several replicas killed leaves the
        others serving (Serve sends its calls to them), and the GPU pool's new requests and moves
        stay there."""
        if replica:
            self._dead.setdefault(self.deployment_of[hop], set()).add(replica)
        if self._live_replicas(hop) - (0 if replica else 1) <= 0:
            self._stall_seen(hop)

    def _failover(self, t: Ticket, kind: str) -> str:
        """Where a stream goes on after its replica died under it: the other pool (FAILOVER),
        unless its own pool has a live replica with a place for it now (another of a GPU
        deployment's replicas, another NUMA node's CPU deployment: Serve sends the call to a live
        one) or the other pool is gone and its own is not."""
        other = FAILOVER[kind]
        load = self.load_view()
        if other == "cpu_decode":  # from a GPU replica: the GPU decode deployment's other replicas
            if self._live_replicas("gpu_decode") and not self._stalled_lately("gpu_decode"):
                # (the dead replica's slots and blocks are in the view until the monitor drops it,
                # and so are its streams in the in-flight count until each has failed over: a place
                # here is one for a stream of it; the blocks each takes count at once, `_decode_on`)
                dec = load.gpu_decode
                if (has_place(dec) and fits(self._view(t, 0), dec)) or self._cpu_gone():
                    return "gpu_decode"
            return other
        live = [c for k, c in zip(self.cpu_keys, self._cpu_loads)
                if self._live_replicas(k) and not self._stalled_lately(k)]
        if any(has_place(c) for c in live) or (live and self._gpu_gone()):
            return "cpu_decode"  # (`_enter` picks the deployment: live ones first)
        return other

    def _hop_ended(self, t: Ticket, end: HopEnd) -> None:
        """The hop's pool took the call and answered (ran it, handed it off, checked in, refused it
        as full, withdrew it): it is not gone, whatever an earlier stall there said."""
        if t.hop in self._stalled and (end.outcome in ("handoff", "withdrawn", "backpressure") or end.finished):
            del self._stalled[t.hop]

    def _stalled_lately(self, hop: str) -> bool:
        """A hop there stalled, and nothing since shows its deployment alive (STALL_MEMORY_S)."""
        s = self._stalled.get(hop)
        if s is not None and self.clock() - s[0] > STALL_MEMORY_S:
            del self._stalled[hop]
            s = None
        return s is not None

    def _cpu_gone(self) -> bool:
        """The monitor's fresh snapshot shows the GPU pool but no live replica of any CPU decode
        deployment (killed, restarting: a replica silent for STALE_AFTER_S is dropped): a stream
        sent there now would wait in Serve's queue for a replacement (about 30 s in the soak).
        Or, sooner than the snapshot says so, a hop of every CPU decode deployment stalled lately
        and none of the GPU's (both stalled: neither is known to be better)."""
        if self._stalled and all(self._stalled_lately(k) for k in self.cpu_keys) and \
                not any(self._stalled_lately(h) for h in ("gpu_prefill", "gpu_decode")):
            return True
        snap = self.snapshot
        if snap is None or self.snapshot_age_s > STALE_SNAPSHOT_S:
            return False
        deps = snap.deployments
        return self.deployment_of["gpu_decode"] in deps and not any(self.deployment_of[k] in deps for k in self.cpu_keys)

    def _gpu_gone(self, hop: str = "gpu_decode") -> bool:
        """`_cpu_gone`'s twin: the fresh snapshot shows a CPU decode deployment but no live replica
        of the GPU deployment of `hop` (killed, its replacement starting), or a hop there stalled
        lately and not one of every CPU decode deployment."""
        if self._stalled and self._stalled_lately(hop) and not all(self._stalled_lately(k) for k in self.cpu_keys):
            return True
        snap = self.snapshot
        if snap is None or self.snapshot_age_s > STALE_SNAPSHOT_S:
            return False
        deps = snap.deployments
        return self.deployment_of[hop] not in deps and any(self.deployment_of[k] in deps for k in self.cpu_keys)

    def _decode_gone(self, hop: str) -> bool:
        """`_cpu_gone` or `_gpu_gone`, for the decode pool `hop` ("cpu_decode" or "gpu_decode")."""
        return self._cpu_gone() if hop == "cpu_decode" else self._gpu_gone()

    def _first_gpu_hop(self) -> str:
        return "gpu_decode" if self.colocated else "gpu_prefill"

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

    # ---- requests: decisions (the ingress's RequestDriver streams the tokens) --------------
    def _decode_on(self, t: Ticket, hop: str, end: HopEnd) -> Ticket:
        """A stream under way goes on decoding on `hop` (gpu_decode or cpu_decode), from its
        hand-off (or, its replica dead, from what its client has): on the GPU its blocks counted
        as taken until the next snapshot; on the CPU for a policy period."""
        if hop == "gpu_decode":
            self._pending_blocks[hop] += self.load_view().gpu_decode.blocks_for(
                self._view(t, end.num_output_tokens).total_tokens)
            return self._enter(t, hop, None)
        t.last_cpu = None
        return self._enter(t, hop, self._cpu_period(t))

    def _enter(self, t: Ticket, hop: str, export_after: int | None) -> Ticket:
        """Send the request to `hop` next: picks the CPU deployment, counts it in flight."""
        if hop == "cpu_decode":
            hop = t.last_cpu = self._pick_cpu(prefer=t.last_cpu or self._caching_cpu(t))
        t.hop, t.export_after, t.error = hop, export_after, None
        t.move_on_preempt = hop == "gpu_decode" and t.pinned_route is None and self.policy.offload_on_preemption()
        # the heads the next hops likely cache, for the hand-off to leave out (router guesses): a move
        # to this hop decided by a pool's check in place; the hand-off after `export_after` tokens,
        # where every hop it may go to caches it
        cached, skip = self._cached_tokens, self.kv_handoff_skip and t.prefix_keys
        t.kv_skip_tokens = cached(t.prefix_keys, t.num_prompt_tokens, hop) if skip else 0
        t.export_skip_tokens = min((cached(t.prefix_keys, t.num_prompt_tokens, h) for h in self._after(t, hop)),
                                   default=0) if skip and (export_after or t.move_on_preempt) else 0
        tokens = self._view(t, 0).total_tokens
        self._active[t.request_id] = (hop, self.clock(), tokens)
        self.inflight[hop] += 1
        self.inflight_tokens[hop] += tokens
        return t

    def _after(self, t: Ticket, hop: str) -> list[str]:
        """The hops a sequence may go to when `hop` hands it off after its `export_after` tokens,
        or preempted there (`_next_hop`): from a CPU pool, the GPU decode pool; from the GPU decode
        pool, a CPU pool (preempted, or pinned `stage`); from a GPU prefill, a CPU pool (pinned
        `stage`) or, as the policy places the decode, either pool."""
        if hop.startswith("cpu_decode"):
            return ["gpu_decode"]
        if hop == "gpu_decode" or t.pinned_route == "stage":
            return self.cpu_keys
        return ["gpu_decode", *self.cpu_keys]

    def _ran(self, t: Ticket, end: HopEnd) -> None:
        """The hop reports the request ran there (it handed the sequence off after tokens made
        there, checks in while decoding there, or finished there by itself): its prompt was
        computed or imported there and stays cached. (Not when it entered: a hand-off on its way
        there, or waiting in the queue, holds nothing there yet, and one of a burst that leaves
        out a head another is still bringing would find it missing.)"""
        if t.hop and t.prefix_keys and (end.outcome == "handoff" or end.in_place or end.finished):
            self.prefixes.record(t.prefix_keys, t.hop)
            node = self._node_tier.get(t.hop)
            if node:  # (its engines write every block they computed into the node's tier)
                self.prefixes.record(t.prefix_keys, NODE_TIER + node)

    def _cached(self, keys, num_prompt_tokens: int, hop: str) -> tuple[int, int, str]:
        """Prompt tokens at the head that `hop` caches (its engines' news, else the router's
        guess): in its engines' own tiers, or in the node's shared tier its replicas read, where a
        request that ran on a hop sharing it wrote them (pools on the same machine; one on
        another machine has a tier of its own). As PoolPrefixes.cached: (tokens, of those in the
        device pool, the farthest tier of the rest)."""
        total, device, far = self.prefixes.cached(keys, num_prompt_tokens, hop)
        node = self._node_tier.get(hop)
        if node:
            in_node = self.prefixes.cached_tokens(keys, num_prompt_tokens, NODE_TIER + node)
            if in_node > total:
                total, far = in_node, far if far and TIER_ORDER[far] > TIER_ORDER["node"] else "node"
        return total, device, far

    def _cached_tokens(self, keys, num_prompt_tokens: int, hop: str) -> int:
        return self._cached(keys, num_prompt_tokens, hop)[0]

    def _load_s(self, hop: str, tokens: int, tier: str) -> float:
        """Seconds `hop`'s engines take to load `tokens` of KV from `tier`, at the bandwidth they
        measured lately (0 while none did: as the engines, loading is then taken as free)."""
        if tokens <= 0 or not tier or self.snapshot is None:
            return 0.0
        dep, rates, block_bytes, block = self.deployment_of[hop], [], 0, PREFIX_BLOCK
        for r in self.snapshot.replicas or ():
            tiers = r.get("kv_tiers") if r.get("deployment") == dep else None
            t = (tiers or {}).get("tiers", {}).get(tier)
            if t and t.get("bandwidth"):
                rates.append(t["bandwidth"])
                block_bytes, block = tiers["block_bytes"], r.get("block_size") or block
        if not rates:
            return 0.0
        return tokens / block * block_bytes / (sum(rates) / len(rates))

    def _leave(self, t: Ticket, end: HopEnd) -> None:
        """The request left its hop: no longer in flight there (if this replica counted it)."""
        entry = self._active.pop(t.request_id, None)
        if entry is not None and entry[0] in self.inflight:
            self.inflight[entry[0]] -= 1
            self.inflight_tokens[entry[0]] -= entry[2]
        if t.hop:
            pool = "gpu" if t.hop.startswith("gpu") else "cpu"
            self._count(f"pool_seconds_total|pool={pool}", end.seconds)

    def _expire(self) -> None:
        """Forget requests whose ingress never reported back (it died): they stop counting."""
        now = self.clock()
        for rid, (hop, since, tokens) in list(self._active.items()):
            if now - since > ACTIVE_TTL_S:
                del self._active[rid]
                self.inflight[hop] -= 1
                self.inflight_tokens[hop] -= tokens

    def _stop(self, t: Ticket, error) -> Ticket:
        t.hop, t.export_after, t.error = None, None, error
        return t

    async def begin(self, t: Ticket) -> Ticket:
        """The first hop of a new request."""
        await self._ready()
        self._expire()
        if t.pinned_route is not None:
            if not self.allow_pinning:
                return self._stop(t, _err(403, "route pinning is turned off on this server", "permission_error"))
            t.route = t.pinned_route
            return self._start(t, "pinned")
        # behind requests already held here, a new one waits its turn
        route = HOLD if self._held else self._route(t, 0.0)
        if route == HOLD:
            return await self._hold(t)
        t.route = route
        return self._start(t, "policy")

    def _route(self, t: Ticket, held_s: float, load: LoadView | None = None) -> str:
        """The policy's route for a new request, except that while the monitor shows no live CPU
        decode replica (killed, its replacement starting) a request it sends to the CPU pool goes
        to the GPU pool instead: its queue is bounded (a clear 503 when full), where Serve's queue
        for a dead deployment waits for the replacement, and a pool killed again and again left
        requests there past their clients' timeouts (the kill soak's lost requests). `load`: the
        view to decide on, if not the router's own."""
        route = self.policy.route(self._view(t, 0, held_s=held_s), self.load_view() if load is None else load)
        if route == "cpu" and self._cpu_gone():
            self._count("requests_rerouted_total|reason=cpu_unavailable")
            return "gpu"
        # and the other way round, for the policies that use the CPU pool at all (`gpu_only` is the
        # baseline: a stall still moves its requests, 20 s on, but no snapshot does), while the CPU
        # pool has a free place: the GPU's streams under way go on there first, and new requests
        # admitted past its places took them (the every-pool kill soak: gaps over 2 s 507 -> 2906);
        # the others queue for the GPU pool's replacement, bounded (20 s, then as stalled; a 503 when full)
        if (route in ("gpu", "stage") and self.policy.name != "gpu_only" and self._gpu_gone(self._first_gpu_hop())
                and not cpu_full(load := self.load_view()) and cpu_place_for_new(self.policy, load)):
            self._count("requests_rerouted_total|reason=gpu_unavailable")
            return "cpu"
        return route

    def _overloaded(self, t: Ticket, kind: str) -> Ticket:
        return self._stop(t, _err(503, f"the {kind} pool is overloaded; retry later", "overloaded_error"))

    async def _reroute_new(self, t: Ticket, kind: str) -> Ticket:
        """A new request that its hop's queue refused (full: the router's view was behind; the
        view now has that hop at its queue bound, `_mark_full_queues`): the policy's route once
        more (`_route`), so a policy that uses both pools sends it to the other
        (`whole_request_route`), or to another CPU deployment with room; where the policy holds
        new requests (`max_hold_s`), HOLD waits here for a place as a new request would; the same
        hop again: a 503."""
        t.backpressured = True
        refused = t.hop
        route = self._route(t, 0.0)
        if route == HOLD:
            self._count("requests_rerouted_total|reason=queue_full")
            return await self._hold(t)
        if route not in ("gpu", "stage", "cpu"):
            return self._overloaded(t, kind)
        if (route == "cpu") == (kind == "cpu_decode") and (route != "cpu" or self._pick_cpu() == refused):
            return self._overloaded(t, kind)
        self._count("requests_rerouted_total|reason=queue_full")
        t.route = route
        return self._enter_first_hop(t)

    def _start(self, t: Ticket, why: str) -> Ticket:
        """Count the request as started and enter the first hop of its route."""
        self._count(f"requests_started_total|route={t.route},reason={why}")
        return self._enter_first_hop(t)

    def _enter_first_hop(self, t: Ticket) -> Ticket:
        if t.route == "cpu":
            return self._enter(t, "cpu_decode", self._cpu_period(t))
        if not self.colocated:  # prefill on GpuPrefill, the KV handed to a decode hop
            return self._enter(t, "gpu_prefill", 1)
        # one GPU engine for both phases: the decision after prefill is a check after the first
        # token there (the sequence decodes on meanwhile; only a move exports it), or none at all
        decide = t.route == "stage" or (t.pinned_route is None and self.policy.decides_after_prefill())
        t = self._enter(t, "gpu_decode", 1 if decide else None)
        t.prefill_check = decide
        return t

    async def _hold(self, t: Ticket) -> Ticket:
        """Wait here until `_release_held` admits the request (a place freed on either pool, or
        the policy's `max_hold_s` ran out). A driver that goes away meanwhile (its client hung up)
        cancels this call: the request leaves the line, or its hop if it was just admitted."""
        held = _Held(t, self.clock(), asyncio.get_running_loop().create_future())
        self._held.append(held)
        self._count("requests_held_total")
        try:
            self._release_held()
            return await held.admitted
        except asyncio.CancelledError:
            if held.admitted.done() and not held.admitted.cancelled():
                self._leave(t, HopEnd("done", 0.0, 0))
            elif held in self._held:
                self._held.remove(held)
            raise

    def _release_held(self) -> None:
        """Admit held requests, oldest first, for as long as the policy finds the oldest a place.
        Called whenever places may have freed: a request finished or moved on, a new snapshot,
        a new policy."""
        now = self.clock()
        while self._held:
            held = self._held[0]
            if held.admitted.done():  # its caller went away
                self._held.popleft()
                continue
            t = held.ticket
            route = self._route(t, now - held.since)
            if route == HOLD:
                return
            self._held.popleft()
            self._count("hold_seconds_total", now - held.since)
            t.route = route
            held.admitted.set_result(self._start(t, "policy"))

    async def advance(self, t: Ticket, end: HopEnd) -> Ticket:
        """The request's hop ended with a hand-off, a full queue or a failure: where next."""
        if t.request_id in self._finished:
            # A pool's period check that crossed the request's end (the sequence decodes on while
            # the pool asks): nothing left to decide or count; entered on a hop again, it would count
            # in flight there for good (ACTIVE_TTL_S) and the policies would see a pool that is not.
            self._count("late_checks_total")
            return t
        await self._ready()
        t = await self._advance(t, end)
        self._release_held()  # after the request entered its next hop: what it left is free only now
        return t

    async def keep_waiting(self, t: Ticket) -> bool:
        """A stream under way whose hop has not been taken within the driver's bound: True when it
        should wait on for that pool rather than move (the driver asks again after another bound,
        up to NEW_HOP_START_BOUND_S): the pool has a replica that reported within LIVE_REPORT_S
        (alive, only slow to start the call: an overloaded replica's event loop), and the other
        pool would make the stream wait too (full, or no live replica). Moved, it waited there in
        the queue mid-stream for a place (the 2x soak: 167 moves in 90 s, gaps of 12-13 s). A
        replica killed stops reporting: its stalled streams move as before, a bound or two on."""
        kind = t.hop.split("/")[0] if t.hop else ""
        if t.pinned_route is not None or kind not in ("gpu_decode", "cpu_decode"):
            return False
        await self._ready()
        load = self.load_view()
        if kind == "gpu_decode":
            other_waits = self._cpu_gone() or cpu_full(load)
        else:
            other_waits = self._gpu_gone() or not gpu_has_room(self.policy, self._view(t, 0), load)
        if not other_waits or not self._reported_lately(self.deployment_of[t.hop]):
            return False
        self._count(f"stalls_waited_total|hop={kind}")
        return True

    def _reported_lately(self, deployment: str) -> bool:
        """A replica of `deployment` reported within LIVE_REPORT_S, by the snapshot held (its
        report's age there, plus how long ago it came)."""
        snap = self.snapshot
        if snap is None:
            return False
        held_for = self.clock() - self._snapshot_at
        return any(r.get("deployment") == deployment and "time_s" in r
                   and snap.time_s - r["time_s"] + held_for <= LIVE_REPORT_S for r in snap.replicas or ())

    async def _advance(self, t: Ticket, end: HopEnd) -> Ticket:
        self._ran(t, end)
        self._hop_ended(t, end)
        self._leave(t, end)
        kind = t.hop.split("/")[0]
        # (the next hop waits NEW_HOP_START_BOUND_S for its pool only right after a stall)
        again, t.stall_moved = t.stall_moved, end.outcome == "stalled"
        # After a colocated GPU engine's prefill the decision is its pool's check, in place (or, pinned
        # to `stage`, the export after the first token). A hand-off the driver reports while the
        # ticket still says `prefill_check` ended the hop before the check's answer (a move comes as
        # the check's own ticket, never here): a preemption, so it goes where preempted GPU decodes
        # go, not back to the engine that just ran out of blocks.
        after_prefill = t.prefill_check and kind == "gpu_decode" and (end.in_place or t.pinned_route is not None)
        t.prefill_check = False
        if end.outcome == "backpressure":  # the pool's bounded queue is full: not a fault
            self._count(f"rejected_total|hop={kind}")
            self._queue_full[t.hop] = self.clock()
            other = "cpu_decode" if kind == "gpu_decode" else "gpu_decode" if kind == "cpu_decode" else None
            if (other and t.pinned_route is None and end.has_handoff and not t.backpressured
                    and not self._decode_gone(other)):
                # prefilled, or a stream under way (its client has tokens), but this decode pool's
                # queue is full: the other pool, once (a 503 here cut the stream mid-way)
                t.backpressured = True
                self._count(f"moves_total|from={kind[:3]},to={other[:3]},reason=backpressure")
                return self._decode_on(t, other, end)
            if other and end.has_handoff:
                # a stream under way with nowhere else to go (moved once already, pinned, or the
                # other pool gone): the same pool again, after REFUSED_RETRY_S (the driver waits),
                # up to REFUSED_WAIT_S, before the 503 that cuts it
                now = self.clock()
                t.refused_since = now if t.refused_since < 0 else t.refused_since
                if now - t.refused_since < REFUSED_WAIT_S:
                    self._count(f"refused_retries_total|hop={kind}")
                    return self._decode_on(t, kind, end)
            if not end.has_handoff and t.pinned_route is None and not t.backpressured:
                return await self._reroute_new(t, kind)
            return self._overloaded(t, kind)
        t.refused_since = -1.0  # (taken: a later refusal waits its own REFUSED_WAIT_S)
        if end.outcome == "stalled":
            # a hop its pool did not take within the driver's bound (the replica is dead and being
            # replaced, or full): the other pool; pinned, the same pool once more first
            self._count(f"stalled_starts_total|hop={kind}")
            self.prefixes.forget(t.hop)  # (its replica may be dead: a replacement caches nothing)
            self._stall_seen(t.hop)
            t.stalls += 1
            if t.stalls > MAX_STALLS:  # neither pool takes it: a clear 503, not a wait without end
                return self._stop(t, _err(503, f"no pool took the request within {t.stalls} tries; retry later",
                                          "unavailable"))
            on_gpu = kind != "cpu_decode"
            if not end.num_output_tokens and not end.has_handoff and t.pinned_route is None:
                # a new request: the other pool's first hop, unless the monitor shows no live
                # replica there (a pool killed again and again looks alive between its deaths: the
                # stall is fresher news than the snapshot, which is why it moves at all)
                gone = self._cpu_gone() if on_gpu else self._gpu_gone(self._first_gpu_hop())
                route = ("gpu" if on_gpu else "cpu") if gone else ("cpu" if on_gpu else "gpu")
                if (route == "cpu") == on_gpu:
                    self._count(f"moves_total|from={'gpu' if on_gpu else 'cpu'},to={route},reason=stalled")
                t.route = route
                return self._enter_first_hop(t)
            if (t.pinned_route is not None or kind not in ("gpu_decode", "cpu_decode")) and not again:
                return self._enter(t, t.hop, t.export_after)  # pinned: the same pool again, up to the longer bound
            # (a pinned stream not taken there twice: its pool is gone for now, a node removed or
            # replicas that cannot be placed; it goes on on the other pool too, not without end)
            other = "cpu_decode" if on_gpu else "gpu_decode"
            if t.pinned_route is None and self._decode_gone(other):
                # no live replica there (killed, its replacement starting): Serve's queue would
                # hold it until one starts; it waits its turn where it is instead
                self._count(f"moves_kept_total|reason={'cpu' if other == 'cpu_decode' else 'gpu'}_unavailable")
                other = "cpu_decode" if other == "gpu_decode" else "gpu_decode"
            else:
                self._count(f"moves_total|from={'gpu' if on_gpu else 'cpu'},to={'cpu' if on_gpu else 'gpu'},"
                            "reason=stalled")
            return self._decode_on(t, other, end)
        if end.outcome == "failed":
            gone = end.error in REPLICA_GONE_ERRORS
            if gone:
                self._replica_gone(t.hop, end.replica)
            if t.recoveries >= MAX_RECOVERIES:
                log.error("hop %s of %s failed (%s); giving up", t.hop, t.request_id, end.error)
                return self._stop(t, _err(503, f"the {kind} replica failed mid-request ({end.error}) "
                                               "and recovery failed", "unavailable"))
            t.recoveries += 1
            self.prefixes.forget(t.hop)  # (its replacement caches nothing)
            nxt = self._failover(t, kind) if gone else FAILOVER[kind]
            log.warning("hop %s of %s failed (%s); continuing on %s after %d tokens", t.hop, t.request_id,
                        end.error, nxt, end.num_output_tokens)
            self._count(f"recoveries_total|hop={kind}")
            # (on the GPU its blocks count as taken at once: a dead replica's streams fail over
            # together, and each must see what the ones before it took there)
            return self._decode_on(t, nxt, end)
        if end.outcome == "withdrawn":  # recalled from a CPU queue before it ran
            # The recall was the decision (the GPU had a place for it, held since in the in-flight
            # count): it goes there. Routed again instead, it met a GPU queue made of the requests
            # recalled just before it (still waiting for their blocks) and went back to the CPU.
            # A recall that lapsed (RECALL_HOLD_S) is routed again, as new.
            recalled = self._recalled.pop(t.request_id, None) is not None
            route = "gpu" if recalled else self._route(t, 0.0)
            if route == HOLD:  # no place anywhere any more: back in line, as new
                return await self._hold(t)
            self._count(f"moves_total|from=cpu,to={'cpu' if route == 'cpu' else 'gpu'},reason=recall")
            t.route = route
            return self._enter_first_hop(t)
        # a hand-off: the policy says where the sequence goes on
        view = self._view(t, end.num_output_tokens)
        nxt, export_after = self._next_hop(t, "gpu_prefill" if after_prefill else kind, view)
        if nxt == "gpu_decode" and not after_prefill:  # (after a colocated prefill it holds its blocks there)
            self._pending_blocks[nxt] += self.load_view().gpu_decode.blocks_for(view.total_tokens)
        src, dst = ("cpu" if kind == "cpu_decode" else "gpu"), ("cpu" if nxt == "cpu_decode" else "gpu")
        if src != dst:
            reason = "pinned" if t.pinned_route else ("offload" if dst == "cpu" else "return")
            self._count(f"moves_total|from={src},to={dst},reason={reason}")
        return self._enter(t, nxt, export_after)

    async def recall(self, waiting: list[Ticket]) -> list[str] | None:
        """A CPU pool's requests that wait there, not started (oldest first): the ids of those
        that should start over on the GPU, now that it has room (their streams end `Withdrawn`
        and each driver comes back through `advance`, which routes it again). None: the policy
        never recalls (the pool asks again much later, in case the policy changes)."""
        await self._ready()
        n = self.policy.recall([self._view(t, 0) for t in waiting], self.load_view())
        if n is None:
            return None
        now = self.clock()
        for t in waiting[:n]:
            self._recalled[t.request_id] = now
        return [t.request_id for t in waiting[:n]]

    async def finish(self, t: Ticket, end: HopEnd) -> None:
        """The request is done (finished, failed with an error, or its client went away, maybe
        while it was held here)."""
        for held in [h for h in self._held if h.ticket.request_id == t.request_id]:
            held.admitted.cancel()
            self._held.remove(held)
        self._ran(t, end)
        self._hop_ended(t, end)
        self._leave(t, end)
        now = self.clock()
        self._finished[t.request_id] = now
        while self._finished:
            rid, since = next(iter(self._finished.items()))
            if now - since <= FINISHED_KEEP_S:
                break
            del self._finished[rid]
        if end.finished:
            self.output_lengths.observe(end.num_output_tokens)
        self._release_held()

    async def finish_many(self, ends: list[tuple[Ticket, HopEnd]]) -> None:
        """Several requests' `finish`, as an ingress replica gathers them (one call for all)."""
        for t, end in ends:
            await self.finish(t, end)

    def _view(self, t: Ticket, num_output_tokens: int, held_s: float = 0.0) -> RequestView:
        cached, load_s = 0, 0.0
        if t.prefix_keys:  # the CPU deployment caching the longest head, and what loading its lower part takes
            (cached, device, far), hop = max((self._cached(t.prefix_keys, t.num_prompt_tokens, k), k)
                                             for k in self.cpu_keys)
            load_s = self._load_s(hop, cached - device, far)
        return RequestView(t.num_prompt_tokens, num_output_tokens, t.max_tokens, self.output_lengths.expected(),
                           held_s, cached, load_s)

    def _cpu_period(self, t: Ticket) -> int | None:
        """Tokens before the next decision on the CPU pool. A pinned request has none unless the
        client asked it to move back (`migrate_back_after`): it stays where it was pinned."""
        if t.pinned_route is not None:
            return t.migrate_back_after
        return self.policy.decode_period_tokens()

    def _next_hop(self, t: Ticket, prev: str, view: RequestView) -> tuple[str, int | None]:
        if prev == "gpu_prefill":  # the hand-off: decode on the GPU, or on the CPU
            if t.route == "stage" or (t.pinned_route is None and
                                      self.policy.after_prefill(view, self.load_view()) == "cpu"):
                if t.pinned_route is None and self._cpu_gone():
                    self._count("moves_kept_total|reason=cpu_unavailable")
                    return "gpu_decode", None
                return "cpu_decode", self._cpu_period(t)
            return "gpu_decode", None
        if prev == "gpu_decode":  # preempted there (out of KV blocks): decode on the CPU pool
            if t.pinned_route is None and self._cpu_gone():  # or wait there for its blocks
                self._count("moves_kept_total|reason=cpu_unavailable")
                return "gpu_decode", None
            if t.pinned_route is None and cpu_full(self.load_view()):
                # no free place there either: it would wait in the CPU pool's queue mid-stream, be
                # given up after HOP_START_BOUND_S and come back here anyway (the 2x soak: 499 such
                # waits in 90 s). Back on the GPU pool with its KV it waits first in line for blocks.
                self._count("moves_kept_total|reason=cpu_full")
                return "gpu_decode", None
            self._count("gpu_preemptions_moved_total")
            return "cpu_decode", self._cpu_period(t)
        if prev == "cpu_decode":  # end of a CPU period
            if t.pinned_route is not None:  # pinned: migrate_back_after moves it back once
                return "gpu_decode", None
            if self.policy.after_period(view, self.load_view()) == "gpu":
                if not self._gpu_gone():
                    return "gpu_decode", None
                self._count("moves_kept_total|reason=gpu_unavailable")  # decodes on where it is
            return "cpu_decode", self.policy.decode_period_tokens()
        raise AssertionError(f"no hop after {prev}")

    async def snapshot_dict(self) -> dict:
        """The figures /metrics shows. While the refresher idles its snapshot may be REFRESH_IDLE_S
        old: a scrape wakes it and answers with the next one (the load as of the scrape)."""
        idle = self._wake is not None
        if idle:
            self._refreshed = fresh = asyncio.Event()
        self._ensure_refresher()
        if idle:
            await _wait_at_most(fresh, FIRST_SNAPSHOT_WAIT_S)
        snap = self.snapshot
        return {"snapshot": snap.to_dict() if snap is not None else None,
                "snapshot_age_s": self.snapshot_age_s, "policy": self.policy.name,
                "inflight": dict(self.inflight), "held": len(self._held), "oldest_s": self._oldest()}

    def _oldest(self) -> dict[str, float]:
        """Per hop (and `held`), how long its oldest request has been there: a request stuck
        somewhere shows as an age that only grows (/metrics `keyacc_oldest_request_age_seconds`)."""
        now, out = self.clock(), {}
        for hop, since, _ in self._active.values():
            out[hop] = max(out.get(hop, 0.0), round(now - since, 3))
        if self._held:  # (oldest first)
            out["held"] = round(now - self._held[0].since, 3)
        return out

    def requests_in_flight(self, limit: int = 50) -> list[dict]:
        """The oldest requests this replica counts on a hop or holds (for an operator, and the
        soak's lost requests): id, where (a hop, or `held`), seconds there."""
        now = self.clock()
        rows = [{"request_id": rid, "hop": hop, "seconds": round(now - since, 3)}
                for rid, (hop, since, _) in self._active.items()]
        rows += [{"request_id": h.ticket.request_id, "hop": "held", "seconds": round(now - h.since, 3)}
                 for h in self._held]
        return sorted(rows, key=lambda r: -r["seconds"])[:limit]
