"""Engine pools: GpuPrefill, GpuDecode and CpuDecode replicas, each running the engine.

Plain classes; `app.py` wraps them with `serve.deployment`. One method, `generate`, serves every
role: a whole request (prompt in, tokens out), a prefill (`export_after=1`: the first token, then
a hand-off) or a decode (a hand-off in, tokens out, and with `export_after=N` a hand-off out
after N tokens). CPU decode in periods of the elastic pipeline (`export_after=N` with the
request's `ticket`): the sequence keeps decoding while the pool asks the router after every N
tokens (`advance`, as the driver would at a hand-off); it is handed off only when the answer is
another hop, so a check that says "stay" costs one small call instead of a KV export, a new
stream and an import.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
import uuid
from types import SimpleNamespace

import ray
import torch
from ray import serve

from keyacc_ray.config import EngineConfig
import numpy as np

from keyacc_ray.engine.kv_package import KVPackage
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.errors import KeyaccError
from keyacc_ray.hw.pinning import pin_process
from keyacc_ray.hw.topology import gpu_info, gpu_local_cpus, numa_nodes
from keyacc_ray.serve.aio import wait_at_most
from keyacc_ray.serve.engine_loop import AsyncEngine, Checkpoint
from keyacc_ray.serve.heap import freeze_startup_heap
from keyacc_ray.serve.monitor import MONITOR_NAME, MONITOR_NAMESPACE  # noqa: F401 - also imported from here
from keyacc_ray.serve.kv_directory import NAME as KV_DIRECTORY, KVDirectory
from keyacc_ray.serve.messages import (ErrorItem, GenerateRequest, Handoff, HopAccepted, HopEnd, SegmentStart,
                                       Ticket, TicketUpdate, TokenChunk)
from keyacc_ray.serve.monitor import ReplicaReport
from keyacc_ray.serve.mux import (Channel, HopSender, MuxAck, Subscribe, hop_sender, mux_hop, subscription,
                                  take_ack)

log = logging.getLogger("ray.serve")
KV_FETCH_TIMEOUT_S = 20.0
KV_TAKE_TIMEOUT_S = 5.0  # how long a hand-off's KV reference may take to reach the directory
KV_HOLD_S = 60.0
ROUTER_NAME = "Router"  # the Router deployment's name in the app (app.py binds it; pools look it up)
REPORT_EVERY_S = 0.2
ROUTER_CHECK_TIMEOUT_S = 10.0
# A request queued here (unstarted) for RECALL_AFTER_S is offered to the router, which may start it
# over on the GPU if that has room by now; one call per replica every RECALL_EVERY_S while any waits.
RECALL_AFTER_S = 0.5
RECALL_EVERY_S = 0.5
RECALL_OFF_RECHECK_S = 5.0  # the policy does not recall (recall_queued off): ask again only this seldom
HEARTBEAT_S = 2.0  # an idle replica's report: this seldom (the monitor drops one silent for STALE_AFTER_S)


class _KVLease:
    """The KV references a hop took from the directory, and whether its sequence has made a token
    here since (then the KV it took no longer describes where the stream is: nothing is given back)."""

    __slots__ = ("refs", "used")

    def __init__(self):
        self.refs: list = []
        self.used = False

    def saw(self, items: list) -> None:
        if self.refs and not self.used and any(isinstance(it, TokenChunk) for it in items):
            self.used = True

    def watch(self, sender) -> SimpleNamespace:
        """`sender` whose `token` (the multiplexed stream's sink) marks the lease used first."""
        def token(chunk):
            self.used = True
            return sender.token(chunk)
        return SimpleNamespace(token=token)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (unit tests)
        return f"local-{uuid.uuid4().hex[:8]}"


class EnginePool:
    pool = "cpu"
    role = "whole"

    def __init__(self, engine: dict, deployment: str | None = None, emulated_gpu: bool = False,
                 cpu_affinity: list[int] | None = None, numa_node: int | None = None,
                 stream_interval_ms: float = 5.0):
        self.deployment = deployment or type(self).__name__
        cfg = EngineConfig.from_dict(engine)
        if numa_node is not None and not cpu_affinity:
            # One replica per NUMA node: its threads on the node's CPUs, and (allocated after
            # pinning, first touch) its weights and KV buffers in the node's memory.
            nodes = {n.node_id: n for n in numa_nodes()}
            node = nodes.get(numa_node)
            if node is None:
                log.warning("NUMA node %s not on this host (%s); not pinning", numa_node, sorted(nodes))
            else:
                cpu_affinity = node.cpus
                if not cfg.num_threads:
                    cfg = cfg.replace(num_threads=len(node.cpus))
        if self.pool == "gpu" and not cpu_affinity and cfg.device != "cpu" and torch.cuda.is_available():
            # GPU replicas run their host threads on the NUMA node their GPU is attached to
            cpu_affinity = gpu_local_cpus(os.environ.get("CUDA_VISIBLE_DEVICES"), gpu_info(), numa_nodes())
        self.numa_node = numa_node
        self.cpus = pin_process(cpu_affinity) if cpu_affinity else None
        if cfg.num_threads:
            os.environ["OMP_NUM_THREADS"] = str(cfg.num_threads)
        stand_in = os.environ.get("KEYACC_TOKEN_SOURCE")  # scripts/bench_stack.py only: no model at all
        if stand_in:
            from keyacc_ray.bench.token_source import TokenSourceEngine

            self.engine = TokenSourceEngine(cfg, float(stand_in))
            log.warning("keyacc %s: a TOKEN SOURCE stands in for the engine (benchmark of the serving stack)",
                        self.deployment)
        else:
            self.engine = LLMEngine(cfg)
            self.engine.label_step_trace(self.pool)
            rate = self.engine.measure_prefill_rate()  # (the policies' input before the first prompt)
            log.info("keyacc %s: prefill rate at start %.0f tokens/s", self.deployment, rate)
        self.emulated = self.pool == "gpu" and self.engine.runner.device.type != "cuda"
        if self.pool == "gpu" and self.emulated and not emulated_gpu:
            raise RuntimeError(f"{self.deployment}: no CUDA device and emulation is off (gpu.emulate_if_no_cuda)")
        self.replica = _replica_id()
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self._calls = 0
        self._held: collections.deque = collections.deque()
        self._kv_dir = None  # the KV directory actor's handle
        if ray.is_initialized():  # made now (a process to start: ~1 s), not in the first hand-off's path
            self._directory()
        self._router_handle = None  # the Router deployment's handle, for period checks, made on first use
        self._unstarted: dict[str, tuple[Ticket, float]] = {}  # engine id -> (ticket, since): queued, no token yet
        self._recaller: asyncio.Task | None = None
        self._late_checks: set[asyncio.Task] = set()  # period checks still asking when their hop ended
        self._muxes: dict[str, Channel] = {}  # ingress replica -> its open token stream from here
        self.loop = AsyncEngine(self.engine, on_export=self._to_handoff, stream_interval_s=stream_interval_ms / 1e3)
        label = ("EMULATED GPU: runs on CPU cores with an emulated KV budget of "
                 f"{self.engine.blocks.num_blocks} blocks x {self.engine.blocks.block_size} tokens"
                 if self.emulated else self.engine.runner.device_label())
        log.info("keyacc %s replica %s ready: model=%s dtype=%s %s; pinned to CPUs %s", self.deployment,
                 self.replica, cfg.model, self.engine.runner.dtype, label, self.cpus or "(none)")
        self._report_wake = threading.Event()  # a request came: report at the busy rate from now
        self._reporter = threading.Thread(target=self._report_loop, name="keyacc-report", daemon=True)
        self._reporter.start()
        freeze_startup_heap(f"{self.deployment} replica {self.replica}")

    # ---- requests ----------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, handoff: Handoff | None = None,
                       export_after: int | None = None, ticket: Ticket | None = None, movable: bool = False,
                       mux: tuple[str, int] | None = None, export_skip: int = 0):
        """One hop of a request. `movable`: preempted here (lazy KV), the sequence ends this hop
        with a hand-off (KV and all) instead of waiting to be recomputed. `mux`: (ingress replica,
        key): if that ingress replica's token stream from here is open, the tokens go on it
        (serve/mux.py) and this call carries the rest. `export_skip`: the hand-off after
        `export_after` tokens, or a movable one's when preempted, leaves this head's K/V out (every
        hop it may go to caches it)."""
        sender = hop_sender(self._muxes, mux)
        async for items in mux_hop(self._hop(req, handoff, export_after, ticket, movable, sender, export_skip),
                                   sender):
            yield items

    async def subscribe(self, sub: Subscribe):
        """An ingress replica's multiplexed token stream from this replica: batches of
        (key, seq, token chunks) of its hops, until it closes or idles (serve/mux.py)."""
        async for batch in subscription(self._muxes, sub, self.replica, self.loop.stream_interval_s):
            yield batch

    async def mux_ack(self, ack: MuxAck) -> None:
        """The ingress replica read that many batches of its token stream from here (flow control)."""
        take_ack(self._muxes, ack, self.replica)

    async def _hop(self, req: GenerateRequest, handoff: Handoff | None, export_after: int | None,
                   ticket: Ticket | None, movable: bool, sender: HopSender | None = None, export_skip: int = 0):
        if handoff is not None:
            phase = "decode"
        else:
            # handed off after its first token: a prefill; else it started here from the prompt
            phase = "prefill" if export_after == 1 and ticket is None else "whole"
        self._report_wake.set()
        # Taken out of Serve's queue: the driver bounds the wait for this, not the import, so a
        # hand-off says so before it reads its KV; a hop with nothing to read says it with its start.
        accepted = [HopAccepted()]
        if handoff is not None:
            yield accepted
            accepted = []
        lease = _KVLease()
        try:
            params = SamplingParams(**req.params)
            package = await self._receive(handoff, lease) if handoff is not None else None
        except KeyaccError as e:
            yield [*accepted, SegmentStart(self.pool, phase, self.replica, self.deployment, self.node_id),
                   ErrorItem(e.status_code, e.to_dict())]
            return
        except BaseException:  # cancelled while it read the KV (CancelledError, GeneratorExit)
            self._give_back(handoff, lease)
            raise
        try:  # until its first token here, a cancelled hop gives the KV back for the next one
            async for items in self._run_hop(req, phase, accepted, package, export_after, ticket, movable, sender,
                                             export_skip, params, lease):
                yield items
        except BaseException:
            self._give_back(handoff, lease)
            raise

    def _give_back(self, h: Handoff, lease: "_KVLease") -> None:
        """A hop cancelled before its sequence made a token here (its driver gave up waiting for it
        to be taken: the replica took it just then) gives the KV it took back under its key, where
        the driver's next hop takes it: not prefilled again. The directory keeps what this hop's
        take got answerable for a while anyway (`KVDirectory.give_back` renews that, and leaves no
        entry a next hop that took the key first would never take); past that, an entry is put:
        the references, or an empty one from a hop cancelled after its tokens began, so that the
        next hop's take answers at once instead of waiting KV_TAKE_TIMEOUT_S for a put that never
        comes (the 2x soak's 9.7 s gap: 5 s of it that wait)."""
        if lease.refs:
            refs, lease.refs = lease.refs, []
            log.info("hop of %s cancelled %s its first token here", h.request_id, "after" if lease.used else "before")
            try:
                self._directory().give_back.remote(h.kv_key, [] if lease.used else refs)
            except Exception as e:  # noqa: BLE001 - directory gone: the next hop prefills again
                log.warning("KV of %s not given back (%s)", h.request_id, e.__class__.__name__)

    async def _run_hop(self, req, phase, accepted, package, export_after, ticket, movable, sender, export_skip,
                       params, lease: "_KVLease"):
        # with a hand-off: did its KV arrive, or is the sequence prefilled again here?
        kv = "" if package is None else ("received" if package.meta.num_kv_tokens > 0 else "recomputed")
        yield [*accepted, SegmentStart(self.pool, phase, self.replica, self.deployment, self.node_id, kv)]
        # A fresh engine-level id per call: a late abort from an earlier hop of the same request
        # (the same request comes back here for its next decode period) can never hit this one.
        self._calls += 1
        rid = f"{req.request_id}/{self._calls}"
        if sender is not None and lease.refs:  # its tokens on the token stream: the first marks the lease used
            sender = lease.watch(sender)
        if ticket is None or not export_after:
            async for items in self.loop.generate(rid, prompt_ids=req.prompt_token_ids, params=params,
                                                  package=package, export_after=export_after, movable=movable,
                                                  sink=sender.token if sender else None, export_skip=export_skip,
                                                  timings=True):
                lease.saw(items)
                yield items
            return
        async for items in self._periods(rid, req, params, package, export_after, ticket, movable, sender,
                                         export_skip):
            lease.saw(items)
            yield items

    async def _periods(self, rid, req, params, package, period: int, ticket: Ticket, movable: bool = False,
                       sender: HopSender | None = None, export_skip: int = 0):
        """Decode in periods: after every `period` tokens the router decides (in a task: the
        sequence keeps decoding meanwhile); its ticket goes to the driver, and if it names another
        hop the sequence is exported at the next step and the stream ends with the hand-off."""
        state = {"ticket": ticket, "started": time.monotonic(), "moving": False}
        updates: list[TicketUpdate] = []
        check: asyncio.Task | None = None
        if package is None and self.pool == "cpu":  # a whole request: while it waits here, the GPU may free up first
            self._unstarted[rid] = (ticket, time.monotonic())
            if self._recaller is None or self._recaller.done():
                self._recaller = asyncio.ensure_future(self._recall_loop())
        try:
            # movable: a colocated GPU engine's request, preempted there, leaves with its KV (as a
            # decode hop's would) instead of being recomputed in place before the router's answer
            sink = None
            if sender is not None:  # its tokens straight to the token stream: it has started
                def sink(chunk, unstarted=self._unstarted, token=sender.token):
                    unstarted.pop(rid, None)
                    return token(chunk)
            async for items in self.loop.generate(rid, prompt_ids=req.prompt_token_ids, params=params,
                                                  package=package, check_every=period, movable=movable,
                                                  sink=sink, export_skip=export_skip, timings=True):
                self._unstarted.pop(rid, None)
                out = []
                for it in items:
                    if isinstance(it, Checkpoint):
                        if (check is None or check.done()) and not state["moving"]:
                            check = asyncio.ensure_future(self._check(rid, it, state, updates))
                    else:
                        out.append(it)
                if out:
                    yield out
            if updates:  # a check answered after the last tokens: the driver still wants the ticket
                yield list(updates)
        finally:
            self._unstarted.pop(rid, None)
            state["ended"] = True
            if check is not None and not check.done():
                # The router has the call and answers it anyway (a request it saw finish: a late
                # check); cancelling it cost a cancellation RPC and a log line for one request in
                # six here. Its answer is dropped: the engine id may come back on a later hop.
                self._late_checks.add(check)
                check.add_done_callback(self._late_checks.discard)

    async def _recall_loop(self) -> None:
        """While requests wait here unstarted: every RECALL_EVERY_S, offer those waiting for
        RECALL_AFTER_S to the router; the ones it recalls leave the engine's queue (if they still
        have not started) and their drivers start them over where the router says."""
        pause = RECALL_EVERY_S
        while self._unstarted:
            await asyncio.sleep(pause)
            pause = RECALL_EVERY_S
            now = time.monotonic()
            due = sorted((since, rid, t) for rid, (t, since) in self._unstarted.items()
                         if now - since >= RECALL_AFTER_S)
            if not due:
                continue
            try:
                ids = await wait_at_most(self._router().options(_by_reference=False).recall.remote(
                    [t for _, _, t in due]), ROUTER_CHECK_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - router restarting or gone: they wait here
                log.warning("recall check failed (%s)", e.__class__.__name__)
                self._router_handle = None
                continue
            if ids is None:
                pause = RECALL_OFF_RECHECK_S
                continue
            for _, rid, t in due:
                if t.request_id in ids and self._unstarted.pop(rid, None) is not None:
                    self.loop.withdraw(rid)

    async def _check(self, rid: str, cp: Checkpoint, state: dict, updates: list) -> None:
        t: Ticket = state["ticket"]
        here = t.hop
        end = HopEnd("handoff", time.monotonic() - state["started"], cp.num_output_tokens, True, in_place=True)
        try:
            nt = await wait_at_most(self._router().options(_by_reference=False).advance.remote(t, end),
                                    ROUTER_CHECK_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - router restarting or gone: keep decoding here
            if not state.get("ended"):
                log.warning("period check of %s failed (%s); decoding on here", t.request_id, e.__class__.__name__)
            self._router_handle = None
            return
        if state.get("ended"):  # the hop ended while the router answered: nothing here to act on
            return
        state["ticket"], state["started"] = nt, time.monotonic()
        if not self.loop.note(rid, TicketUpdate(nt)):  # at once in its stream; or, if it has ended, after it
            updates.append(TicketUpdate(nt))
        if nt.hop != here:  # move: the stream ends with the hand-off (or the request finished first)
            state["moving"] = True
            self.loop.export(rid, nt.kv_skip_tokens)  # (less the head the router expects cached there)
        elif not nt.export_after:  # it stays for good (a colocated GPU prefill's decode): no more checks
            self.loop.stop_checks(rid)

    def _router(self):
        if self._router_handle is None:
            self._router_handle = serve.get_deployment_handle(ROUTER_NAME, serve.get_replica_context().app_name)
        return self._router_handle

    async def _receive(self, h: Handoff, lease: "_KVLease") -> KVPackage:
        """Fetch the KV arrays (a zero-copy view when on this node). If their owner died before
        we read them, continue from prompt + tokens so far with no KV: a prefill, not a failure."""
        keys = values = None
        meta = h.meta
        refs = h.kv_ref
        if h.kv_key and not refs:
            try:
                refs = await wait_at_most(self._directory().take.remote(h.kv_key, KV_TAKE_TIMEOUT_S),
                                          KV_FETCH_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - directory restarting or gone: prefill again
                log.warning("KV directory unavailable for %s (%s)", h.request_id, e.__class__.__name__)
                self._kv_dir = None
            if not refs:
                log.warning("KV of %s not found in the directory; prefilling %d tokens again", h.request_id,
                            len(h.token_ids) - 1)
            lease.refs = list(refs or [])
        if refs:
            try:
                keys, values = await wait_at_most(refs[0], KV_FETCH_TIMEOUT_S)
            except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError,
                    ray.exceptions.ObjectFetchTimedOutError, asyncio.TimeoutError) as e:
                log.warning("KV of %s lost (%s); prefilling %d tokens again", h.request_id,
                            e.__class__.__name__, len(h.token_ids) - 1)
        if keys is None:  # no KV (lost, or a recovery hand-off): prefill prompt + tokens so far
            meta = self.engine.kv_meta("LHTD", 0, "none")
            keys = values = np.zeros((0,), dtype=np.float32)
        return KVPackage(meta, keys, values, h.request_id, list(h.token_ids), h.num_prompt_tokens, dict(h.params),
                         h.rng_state, h.emitted_text_chars)

    def _to_handoff(self, pkg: KVPackage) -> Handoff:
        """Runs on the engine thread: put the K/V arrays into the object store (no pickling of
        tensors: numpy buffers, zero-copy for the reader on this node)."""
        ref = [ray.put((pkg.keys, pkg.values))] if pkg.meta.num_kv_tokens > 0 else []
        key = ""
        if ref:
            # The reference waits in the KV directory; the hand-off carries its key (token
            # streams travel over gRPC, pickled). Hold our own reference for a while too, so the
            # object outlives the put's flight to the directory.
            key = f"{pkg.request_id}/{uuid.uuid4().hex}"
            try:
                self._directory().put.remote(key, ref)
            except Exception as e:  # noqa: BLE001 - the receiver prefills again
                log.warning("KV directory unavailable (%s); %s will be prefilled again", e.__class__.__name__,
                            pkg.request_id)
                self._kv_dir = None
        now = time.monotonic()
        self._held.extend((now, r) for r in ref)
        while self._held and now - self._held[0][0] > KV_HOLD_S:
            self._held.popleft()
        return Handoff(pkg.request_id, pkg.meta, [], pkg.token_ids, pkg.num_prompt_tokens, pkg.params,
                       pkg.rng_state, pkg.emitted_text_chars, pkg.nbytes, key)

    def _directory(self):
        if self._kv_dir is None:
            self._kv_dir = ray.remote(KVDirectory).options(
                name=KV_DIRECTORY, namespace=MONITOR_NAMESPACE, get_if_exists=True, lifetime="detached",
                max_restarts=-1, num_cpus=0).remote(KV_HOLD_S)
        return self._kv_dir

    # ---- load reports ------------------------------------------------------------------
    def report(self) -> ReplicaReport:
        s = self.engine.stats()
        return ReplicaReport(self.deployment, self.pool, self.role, self.replica, s.num_waiting, s.num_running,
                             s.num_free_blocks, s.num_total_blocks, s.block_size, s.max_num_seqs,
                             self.loop.tokens_per_s(), s.tokens_generated, self.emulated, s.device,
                             num_preemptions=s.num_preemptions, prefix_cache_queries=s.prefix_cache_queries,
                             prefix_cache_hits=s.prefix_cache_hits, prefix_cache_evictions=s.prefix_cache_evictions,
                             num_cached_blocks=s.num_cached_blocks, kv_tiers=s.kv_tiers,
                             histograms=s.histograms, prefill_tokens_per_s=round(s.prefill_tokens_per_s, 1),
                             steps_launched_ahead=s.steps_launched_ahead,
                             kv_export_skipped_tokens=s.kv_export_skipped_tokens,
                             kv_import_cached_tokens=s.kv_import_cached_tokens,
                             kv_import_recomputed_tokens=s.kv_import_recomputed_tokens, max_waiting=s.max_waiting,
                             node_tier=f"{self.node_id}:{s.kv_tiers['node_dir']}"
                             if s.kv_tiers and s.kv_tiers.get("node_dir") else "")

    def _report_loop(self) -> None:
        """A report every REPORT_EVERY_S while the load changes; an idle replica sends the same
        report only every HEARTBEAT_S (well inside the monitor's STALE_AFTER_S). An idle engine
        (nothing running or waiting) is looked at only every HEARTBEAT_S too, until a request
        comes (`generate` wakes this loop: the busy rate again, from the request's arrival)."""
        monitor, last, sent_at, busy_until = None, None, 0.0, 0.0
        events = getattr(self.engine, "kv_events", None)
        while self.loop.alive():
            now = time.monotonic()
            try:
                if monitor is None:
                    monitor = ray.get_actor(MONITOR_NAME, namespace=MONITOR_NAMESPACE)
                r = self.report()
                if r.num_running or r.num_waiting:
                    busy_until = now + HEARTBEAT_S
                if events is not None:  # where its prefix blocks went since (the router's prefix view)
                    r.kv_events = events.drain() or None
                content = r.content()
                if content != last or r.kv_events or now - sent_at >= HEARTBEAT_S:
                    monitor.report.remote(r)
                    last, sent_at = content, now
            except Exception:  # noqa: BLE001 - the monitor may be (re)starting; keep serving
                monitor, last = None, None
                if events is not None:  # (what it was told may be lost with it)
                    events.resync()
            if now < busy_until or last is None:
                self._report_wake.clear()
                time.sleep(REPORT_EVERY_S)
            elif self._report_wake.wait(HEARTBEAT_S):
                # a request came (the engine may not have taken it in yet): the busy rate for a while
                busy_until = time.monotonic() + HEARTBEAT_S
                self._report_wake.clear()
                time.sleep(REPORT_EVERY_S / 4)

    async def stats(self) -> ReplicaReport:
        return self.report()

    def check_health(self) -> None:
        if not self.loop.alive() or self.loop.error is not None:
            raise RuntimeError(f"engine loop is down: {self.loop.error!r}")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()


class GpuPrefill(EnginePool):
    pool, role = "gpu", "prefill"


class GpuDecode(EnginePool):
    pool, role = "gpu", "decode"


class CpuDecode(EnginePool):
    pool, role = "cpu", "decode"
