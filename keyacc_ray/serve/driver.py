"""The request path's data plane: walks one request through its hops and streams its tokens.

The router decides (which pool, for how many tokens, what after a hand-off, a failure or a
full queue); this driver, running inside each ingress replica, does: it calls the chosen pool,
streams the tokens straight to the client, and asks the router again when the hop ends. Tokens
therefore cross one Serve hop (pool -> ingress) instead of two, and the router sees a few small
calls per request instead of every token. Hops: GPU prefill -> (hand-off) -> GPU or CPU decode,
CPU decode in periods after which the router may move the decode back. The CPU pool asks the
router itself after each period (the sequence keeps decoding meanwhile) and sends the answer
along as a `TicketUpdate`: the driver takes it as its own and, when it names another hop, goes
on there after the hand-off without asking again.

If the router cannot be reached, the driver decides alone (`fallback`): finish where the
request is, fail over as usual. No Ray import here: pools and the router come in as handles
(or, in tests, as objects with the same methods).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time

from keyacc_ray.serve.aio import wait_at_most
from keyacc_ray.serve.mux import MuxClient
from keyacc_ray.serve.messages import (REPLICA_GONE_ERRORS, ErrorItem, GenerateRequest, Handoff, HopAccepted, HopEnd,
                                       HopTimings, SegmentStart, Ticket, TicketUpdate, TokenChunk, Trace, Withdrawn)

log = logging.getLogger("ray.serve")
ROUTER_TIMEOUT_S = 10.0
FINISH_GATHER_S = 0.02  # requests ending within this of each other tell the router in one call
MAX_RECOVERIES = 2
# A stream under way (the client has tokens) whose next hop's replica has not taken the call by
# then (it waits in Serve's queue: the replica died and is being replaced, or it is full) goes on
# on the other pool instead, once per request: the client's longest gap stays near this.
HOP_START_BOUND_S = 1.0
# A new request (no token yet) waits for its first place longer, as a queue does, but not without
# end: a hop whose replica has not taken it by then (Serve's queue for a pool whose replicas died
# and are being replaced, again and again under the kill soak, kept requests past their clients'
# timeouts: on the CPU pool, and on the GPU pool when its replica was killed) starts over on the
# other pool. The hop right after a stall (a stream moved by it, a pinned request stalled once on
# its own pool) waits this long too. (A live pool's full queue is bounded: Serve refuses past it, a clear 503.)
NEW_HOP_START_BOUND_S = 20.0
MAX_STALLS = 4  # hops of one request not taken in time: past it a 503, never a wait without end
# A stream under way that every pool it may go to refused (their bounded queues full; the other
# pool full or gone) asks the same pool again this long after each refusal, for up to
# REFUSED_WAIT_S in all, before a 503 cuts it (its client has tokens: the 2x kill soak cut such
# streams after their first token, the CPU replica dead and the GPU's queue full).
REFUSED_RETRY_S = 0.5
REFUSED_WAIT_S = 20.0
# At the bound of a stream under way the router is asked first whether the stream should wait on
# where it is (`Router.keep_waiting`: its pool alive, the other full too); this long at most. (At
# twice the capacity its answers took 0.3 s on average to reach the ingress, over 1 s in the tail:
# the ingress's Serve handles carry every token too. A router that answers promptly says "move"
# to a stream whose replica died within milliseconds; a slow answer means an overloaded server.)
KEEP_ASK_S = 3.0
STALL_LATE_S = 0.05  # a bound's timer run later than this: the bound is extended by its lateness
STALL_REARMS = 3
# Pool streams and router calls use Serve's gRPC transport (`_by_reference=False`): per streamed
# item it costs the ingress about half the CPU of Ray's task streaming (docs/benchmarks.md).
# Nothing in them may be an ObjectRef (a pickled ref pins its object): hand-offs carry the KV
# directory's key instead (serve/kv_directory.py).
POOL_CALL = {"stream": True, "_by_reference": False}
ROUTER_CALL = {"_by_reference": False}
# Where a request goes on when a replica dies under it (the dead one is being replaced).
FAILOVER = {"gpu_prefill": "cpu_decode", "gpu_decode": "cpu_decode", "cpu_decode": "gpu_decode"}
# A hop that failed with its replica's actor gone (messages.REPLICA_GONE_ERRORS): the other
# hops this ingress has waiting to be taken on the same hop key are given up at once, as their
# bound would give them up, instead of waiting the bound out in Serve's queue for the replacement
# (about 20 s in the kill soak: a new request's whole NEW_HOP_START_BOUND_S). The router hears of
# it too (router.py: the pool counts as gone for its moves, if no other replica of it lives).
# With several replicas behind the hop key nothing is given up: Serve sends the waiting hops to
# the live replicas (it drops a dead one from its choice at the first call that finds it dead),
# and a hop it had sent to the dead one fails by itself.


def error_item(status: int, message: str, type_: str = "internal_error") -> ErrorItem:
    return ErrorItem(status, {"error": {"message": message, "type": type_, "param": None, "code": None}})


def refused_new(items: list) -> bool:
    """A new request's first hop answered only that its engine's waiting queue is full
    (`Overloaded`, a 503): backpressure, as Serve's own queue gives it, for the router to decide."""
    return (len(items) == 1 and isinstance(items[0], ErrorItem) and items[0].status_code == 503
            and items[0].body.get("error", {}).get("type") == "overloaded_error")


def is_backpressure(e: BaseException) -> bool:
    """Serve's BackPressureError (a pool's bounded queue is full), by name: no Ray import here."""
    return type(e).__name__ == "BackPressureError"


class RemoteRouter:
    """The router deployment behind its handle, as the driver calls it. `finish` is bookkeeping
    nobody waits for: those ending within FINISH_GATHER_S of each other go in one call (a router
    call costs the router and the ingress about a millisecond of CPU each, mostly gRPC's; at 50
    requests a second, one of the two calls each request made)."""

    def __init__(self, handle):
        self.handle = handle
        self._ends: list[tuple[Ticket, HopEnd]] = []

    async def begin(self, t: Ticket) -> Ticket:
        return await self.handle.options(**ROUTER_CALL).begin.remote(t)

    async def advance(self, t: Ticket, end: HopEnd) -> Ticket:
        return await self.handle.options(**ROUTER_CALL).advance.remote(t, end)

    async def keep_waiting(self, t: Ticket) -> bool:
        return await self.handle.options(**ROUTER_CALL).keep_waiting.remote(t)

    async def finish(self, t: Ticket, end: HopEnd) -> None:
        self._ends.append((t, end))
        if len(self._ends) > 1:  # the first of these sends them all
            return
        try:
            await asyncio.sleep(FINISH_GATHER_S)
        finally:  # (cancelled: the ingress is going away; the counts expire on the router's side)
            ends, self._ends = self._ends, []
        try:
            await wait_at_most(self.handle.options(**ROUTER_CALL).finish_many.remote(ends), ROUTER_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the counts expire on the router's side
            log.warning("router finish for %d requests (%s, ...) failed (%s)", len(ends), ends[0][0].request_id,
                        e.__class__.__name__)


def _stalled(stream, waiting: dict, due: float) -> None:
    """The hop's bound ran out. If the event loop ran this timer late, the replica's first item
    may be waiting to be read (the loop was busy: an ingress at its limit runs its timers hundreds
    of ms late, and called hops that were taken stalls): the bound is extended by that lateness,
    up to STALL_REARMS times, before the call is given up. A stream under way asks the router
    first (`waiting["keep"]`) whether to wait on where it is, up to NEW_HOP_START_BOUND_S in all."""
    loop = asyncio.get_running_loop()
    late = loop.time() - due
    if late > STALL_LATE_S and waiting["rearms"] < STALL_REARMS:
        waiting["rearms"] += 1
        waiting["timer"] = loop.call_later(late, _stalled, stream, waiting, loop.time() + late)
        return
    waiting["late"] = late
    keep = waiting.get("keep")
    if keep is not None and loop.time() - waiting["since"] + HOP_START_BOUND_S <= NEW_HOP_START_BOUND_S:
        task = waiting["timer"] = loop.create_task(_keep_or_give_up(stream, waiting, keep))
        _ASKS.add(task)  # (held: the loop holds tasks weakly)
        task.add_done_callback(_ASKS.discard)
        return
    waiting["stalled"] = True
    stream.cancel()


_ASKS: set[asyncio.Task] = set()


async def _keep_or_give_up(stream, waiting: dict, keep) -> None:
    """The router's answer for a stream under way past its bound: wait another bound for the
    replica to take it, or give the call up (also when the router does not answer in KEEP_ASK_S).
    Cancelled (by the driver) when the hop's first item comes meanwhile."""
    try:
        kept = await wait_at_most(keep(), KEEP_ASK_S)
    except Exception:  # noqa: BLE001 - no answer: as without one (a cancellation is not an Exception)
        kept = False
    loop = asyncio.get_running_loop()
    if kept:
        waiting["kept"] = waiting.get("kept", 0) + 1
        waiting["timer"] = loop.call_later(HOP_START_BOUND_S, _stalled, stream, waiting,
                                           loop.time() + HOP_START_BOUND_S)
        return
    waiting["timer"] = None
    waiting["stalled"] = True
    stream.cancel()


def fallback(t: Ticket, end: HopEnd | None, colocated: bool = False) -> Ticket:
    """The driver's own decision when the router does not answer: no policy, no moves by load.
    `colocated`: one GPU engine serves both phases (there is no GpuPrefill hop to go to)."""
    # no router to send a preempted decode on, nor to ask after a prefill
    t = dataclasses.replace(t, error=None, move_on_preempt=False, prefill_check=False)
    gpu_start = ("gpu_decode", None) if colocated else ("gpu_prefill", 1)
    if end is None:  # start: a pinned CPU request on the CPU pool, everything else on the GPU pools
        t.route = t.pinned_route or "gpu"
        t.hop, t.export_after = ("cpu_decode/0", None) if t.route == "cpu" else gpu_start
        return t
    kind = t.hop.split("/")[0]
    t.stall_moved = end.outcome == "stalled"
    if end.outcome == "handoff":  # finish where the request is
        t.hop = t.hop if kind == "cpu_decode" else "gpu_decode"
        t.export_after = None
    elif end.outcome == "stalled" and t.stalls < MAX_STALLS:  # its pool did not take it in time: the other
        t.hop = "gpu_decode" if kind == "cpu_decode" else "cpu_decode/0"
        t.export_after, t.stalls = None, t.stalls + 1
    elif end.outcome == "withdrawn":  # recalled unstarted: start over on the GPU pools
        t.hop, t.export_after = gpu_start
    elif end.outcome == "failed" and t.recoveries < MAX_RECOVERIES:
        t.recoveries += 1
        t.hop = "cpu_decode/0" if FAILOVER[kind] == "cpu_decode" else FAILOVER[kind]
        t.export_after = None
    else:
        t.hop = None
        t.error = error_item(503, f"the {kind} pool is unavailable; retry later", "unavailable")
    return t


class RequestDriver:
    def __init__(self, router, hops: dict, mux: MuxClient | None = None, replicas: dict | None = None):
        """router: RemoteRouter (or the Router itself, in process); hops: the pool handles by hop
        key ("gpu_prefill", "gpu_decode", "cpu_decode/0", ...); mux: this ingress replica's
        multiplexed token streams (serve/mux.py), or None for one stream per hop; replicas: how
        many replicas serve each hop key (1 where not said)."""
        self.router = router
        self.hops = hops
        self.replicas = replicas or {}
        self.mux = mux
        self._tasks: set[asyncio.Task] = set()
        self._untaken: dict[str, dict[int, tuple]] = {}  # hop key -> its hops not taken yet: (stream, waiting)

    async def _ask(self, t: Ticket, end: HopEnd | None) -> Ticket:
        try:
            call = self.router.begin(t) if end is None else self.router.advance(t, end)
            return await wait_at_most(call, ROUTER_TIMEOUT_S)
        except asyncio.CancelledError:  # the client went away while the router decided (or held it)
            self._finish(t, HopEnd("done", 0.0, end.num_output_tokens if end else 0))
            raise
        except Exception as e:  # noqa: BLE001 - router restarting or gone: decide here
            log.warning("router unavailable for %s (%s); deciding locally", t.request_id, e.__class__.__name__)
            return fallback(t, end, colocated="gpu_prefill" not in self.hops)

    def _finish(self, t: Ticket, end: HopEnd) -> None:
        """Bookkeeping only: the client does not wait for it. It runs as a task held here until
        it is done (the loop holds tasks weakly: a task nobody holds can be collected before the
        call is sent, and the router would count the request in flight until it expires)."""
        try:
            task = asyncio.get_running_loop().create_task(self.router.finish(t, end))
        except Exception:  # noqa: BLE001 - bookkeeping only
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _give_up_untaken(self, hop: str, why: str) -> None:
        """A hop on `hop` failed with its replica gone: every hop still waiting to be taken there
        is given up now, each as its bound would (the router sends it on elsewhere)."""
        waiters = self._untaken.pop(hop, {})
        for stream, waiting in waiters.values():
            if waiting["timer"] is not None:
                waiting["timer"].cancel()
                waiting["timer"] = None
            waiting["stalled"] = True
            stream.cancel()
        if waiters:
            log.warning("a hop on %s failed (%s): %d hops waiting to be taken there given up", hop, why, len(waiters))

    async def run(self, req: GenerateRequest):
        """Yields lists of TokenChunk / ErrorItem, then [Trace]."""
        began = time.monotonic()  # each segment's start_ms / first_token_ms count from here
        t = await self._ask(Ticket.of(req), None)
        trace = Trace()
        handoff: Handoff | None = None
        handed_at = 0.0
        ended_at: float | None = None  # when the last hop ended here (its hand-off, failure, stall or refusal)
        last_token_at: float | None = None  # when the current segment's last token reached the ingress
        generated: list[int] = []  # every token streamed to the client so far
        emitted_chars = 0
        finish_reason = None
        while t.error is None and t.hop is not None:
            started = time.monotonic()
            had = len(generated)  # tokens the client had when this hop began
            next_handoff = None
            outcome, err_name = "done", ""
            refused_here = False  # a new request its engine's full queue refused
            stream = hop = None
            segment_started = False  # this hop's replica said where it runs
            decided: Ticket | None = None  # the pool's check after a CPU period chose the next hop
            # Policy periods on the CPU: the pool checks with the router itself (a move lands a few
            # tokens after the period, when the answer comes). A pinned `migrate_back_after` moves
            # after exactly that many tokens: the old way, a hand-off at the period's end.
            # The same for the decision after a colocated GPU engine's prefill (`prefill_check`).
            in_periods = ({"ticket": t} if (t.hop.startswith("cpu_decode") or t.prefill_check) and t.export_after
                          and t.pinned_route is None else {})
            waiting = {"stalled": False, "timer": None, "rearms": 0}  # for the replica to take a stream under way
            try:
                if t.move_on_preempt:
                    in_periods["movable"] = True
                if t.export_skip_tokens and (t.export_after or t.move_on_preempt):
                    in_periods["export_skip"] = t.export_skip_tokens  # (its hand-off's next hops cache that head)
                if self.mux is not None:  # its tokens may come on the replica's multiplexed stream
                    hop = self.mux.open(t.hop)
                    in_periods.update(hop.call_kwargs)
                stream = self.hops[t.hop].options(**POOL_CALL).generate.remote(req, handoff, t.export_after,
                                                                               **in_periods)
                # Every hop has a bound: a pool whose replicas keep dying looks alive to the monitor
                # between deaths, and Serve's queue for it waits for a replacement without end
                # (requests waited there past their clients' timeouts in the kill soak)
                under_way = bool(generated) and not t.stall_moved
                bound = HOP_START_BOUND_S if under_way else NEW_HOP_START_BOUND_S
                loop = asyncio.get_running_loop()
                if under_way and t.pinned_route is None and hasattr(self.router, "keep_waiting"):
                    waiting["keep"], waiting["since"] = functools.partial(self.router.keep_waiting, t), loop.time()
                waiting["timer"] = loop.call_later(bound, _stalled, stream, waiting, loop.time() + bound)
                untaken = self._untaken.setdefault(t.hop, {})
                untaken[id(waiting)] = (stream, waiting)
                async for items in (stream if hop is None else hop.attach(stream)):
                    if waiting["timer"] is not None:  # anything from the hop (its HopAccepted, or its
                        waiting["timer"].cancel()     # tokens when they overtake that): it took it
                        waiting["timer"] = None
                        untaken.pop(id(waiting), None)
                    out = []
                    for it in items:
                        if isinstance(it, HopAccepted):
                            pass
                        elif isinstance(it, TicketUpdate):
                            if it.ticket.hop == t.hop:  # the next period, where it is
                                t = it.ticket
                                if trace.segments and t.hop.startswith("cpu_decode"):
                                    trace.segments[-1]["periods"] += 1
                            else:
                                decided = it.ticket
                        elif isinstance(it, SegmentStart):
                            new_segment = trace.start(it)
                            if new_segment:  # when its replica took it, as the ingress saw that; and when
                                # this hop was sent (after the last one ended and the router chose it)
                                trace.segments[-1]["start_ms"] = round((time.monotonic() - began) * 1e3, 2)
                                trace.segments[-1]["sent_ms"] = round((started - began) * 1e3, 2)
                                if ended_at is not None:  # (sent less this: the router's answer)
                                    trace.segments[-1]["prev_end_ms"] = round((ended_at - began) * 1e3, 2)
                                last_token_at = None
                            if new_segment and handoff is not None and it.kv == "received":
                                # the hand-off that brought it: its KV bytes, and from the end of the
                                # last hop to this one's start (export, object store, import)
                                trace.segments[-1]["kv_bytes"] = handoff.kv_bytes
                                trace.segments[-1]["handoff_ms"] = round((time.monotonic() - handed_at) * 1e3, 2)
                                if handoff.meta is not None and handoff.meta.kv_start:  # left out: cached there
                                    trace.segments[-1]["kv_skipped_tokens"] = handoff.meta.kv_start
                            segment_started = True
                        elif isinstance(it, Handoff):
                            next_handoff = it
                        elif isinstance(it, HopTimings):  # where the hop's tokens waited in its replica
                            trace.hop_timings(it)
                        elif isinstance(it, Withdrawn):  # recalled from the pool's queue, unstarted
                            outcome = "withdrawn"
                            if segment_started:
                                trace.segments[-1]["withdrawn"] = True
                        else:
                            if isinstance(it, TokenChunk):
                                now = time.monotonic()
                                if it.token_ids and trace.segments and "first_token_ms" not in trace.segments[-1]:
                                    # its first token here: TTFT at the ingress for the first segment
                                    trace.segments[-1]["first_token_ms"] = round((now - began) * 1e3, 2)
                                elif last_token_at is not None:  # the longest wait between its tokens here
                                    trace.token_gap(now - last_token_at, last_token_at - began,
                                                    hop.inbox if hop is not None else None)
                                last_token_at = now
                                trace.add_tokens(len(it.token_ids))
                                generated.extend(it.token_ids)
                                emitted_chars += len(it.text)
                                finish_reason = it.finish_reason or finish_reason
                            out.append(it)
                    if not generated and handoff is None and t.pinned_route is None and refused_new(out):
                        refused_here = True  # the router may send it elsewhere (the call ends by itself)
                        if segment_started:
                            trace.segments[-1]["refused"] = True
                        continue
                    if out:
                        yield out
                    if any(isinstance(i, ErrorItem) for i in out):
                        self._finish(t, HopEnd("done", time.monotonic() - started, len(generated)))
                        return
                if next_handoff is not None:
                    outcome = "handoff"
                elif refused_here:
                    outcome, err_name = "backpressure", "Overloaded"
            except (asyncio.CancelledError, GeneratorExit):  # the client went away
                if stream is not None:
                    stream.cancel()  # the pool aborts the sequence and frees its blocks
                self._finish(t, HopEnd("done", time.monotonic() - started, len(generated)))
                raise
            except Exception as e:  # noqa: BLE001 - a full queue, or a replica died / the stream broke
                outcome, err_name = ("backpressure" if is_backpressure(e) else "failed"), e.__class__.__name__
                if waiting["stalled"]:  # cancelled here: its replica did not take it in time
                    outcome = "stalled"
                    log.warning("hop %s of %s not taken within %.1f s after %d tokens (its timer extended %d "
                                "times, last run %.0f ms late; waited on %d times)", t.hop, req.request_id,
                                time.monotonic() - started, len(generated), waiting["rearms"],
                                waiting.get("late", 0.0) * 1e3, waiting.get("kept", 0))
                    if segment_started:  # (it had: the cancellation crossed its acceptance)
                        trace.segments[-1]["stalled"] = True
                elif outcome == "failed":
                    log.warning("hop %s of %s failed (%s: %s) after %d tokens", t.hop, req.request_id, err_name,
                                str(e)[:200], len(generated))
                    if segment_started:
                        trace.segments[-1]["failed"] = True
                    if stream is not None:  # if its replica still runs it (lost tokens), it stops there
                        stream.cancel()
                    if err_name in REPLICA_GONE_ERRORS and self.replicas.get(t.hop, 1) <= 1:
                        self._give_up_untaken(t.hop, err_name)
            finally:
                if waiting["timer"] is not None:
                    waiting["timer"].cancel()
                self._untaken.get(t.hop, {}).pop(id(waiting), None)
                if hop is not None:
                    hop.close()
            if outcome in ("failed", "stalled") and finish_reason in ("stop", "length"):
                # its last token reached the client before the hop's end did (its replica died in
                # between): the request is complete, nothing to go on with (a recovery from every
                # token it may make was refused as "no tokens left": the 2x kill soak's cut streams)
                outcome = "done"
            ended_at = time.monotonic()
            end = HopEnd(outcome, ended_at - started, len(generated), handoff is not None, err_name,
                         finished=finish_reason in ("stop", "length"),
                         replica=trace.segments[-1]["replica"] if segment_started and outcome == "failed" else "")
            if outcome == "done":
                self._finish(t, end)
                break
            if outcome == "handoff":
                handoff, handed_at = next_handoff, time.monotonic()
                if decided is not None:  # the router already chose (and counted) the next hop
                    t = decided
                    continue
            elif outcome == "failed" or len(generated) > had:
                # Go on elsewhere from what the client already has: prompt + tokens so far, no
                # KV (prefilled again there); greedy output stays exact. Nothing yet: start over.
                # (Also a hop that streamed and then ended with no hand-off of its own, such as
                # one cancelled as stalled just as its replica took it: the hand-off that began it
                # is behind the client now.)
                handoff = (Handoff(req.request_id, None, [], list(req.prompt_token_ids) + generated,
                                   len(req.prompt_token_ids), req.params, None, emitted_chars)
                           if generated else None)
                end.has_handoff = handoff is not None
            refused = t.hop.split("/")[0] if outcome == "backpressure" else None
            t = await self._ask(t, end)
            if refused is not None and t.hop is not None and t.hop.split("/")[0] == refused:
                await asyncio.sleep(REFUSED_RETRY_S)  # the same pool again: give its queue a moment
        if t.error is not None:
            yield [t.error]
            return
        yield [trace]
