"""The request path without Ray: the ingress's RequestDriver walking requests through fake pools,
with the real Router (in process) deciding every hop. The end-to-end tests run the same code
through Serve with the real engine."""
from __future__ import annotations

import asyncio
import copy
import time

import pytest

from keyacc_ray.errors import Overloaded
from keyacc_ray.serve.driver import RequestDriver
from keyacc_ray.serve.messages import (ErrorItem, GenerateRequest, Handoff, HopAccepted, HopEnd, SegmentStart,
                                       Ticket, TicketUpdate, TokenChunk, Trace, Withdrawn)
from keyacc_ray.serve.mux import MuxClient, hop_sender, mux_hop, subscription, take_ack
from keyacc_ray.serve.router import REFRESH_EVERY_S, Router, hop_keys

PROMPT = [1, 2, 3, 4]
MUX = {"on": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["one-stream-per-hop", "mux"])
def _mux(request):
    """Every test here runs twice: with one stream per hop, and with the multiplexed token
    streams (serve/mux.py: the pools' real muxing code, the driver's real MuxClient)."""
    MUX["on"] = request.param
    yield request.param
    MUX["on"] = False


class BackPressureError(Exception):  # what Serve raises when a pool's bounded queue is full
    pass


class _Unreachable:
    class _M:
        def remote(self, *a):
            raise ConnectionError("no monitor in this test")

    snapshot = _M()
    add_counters = _M()


class FakeMonitor:
    """The load monitor actor as the router calls it: `snapshot.remote(since, kv_after)` answers
    with `answer(since)` (a coroutine function: a Snapshot, or None for "nothing changed"), and
    `add_counters.remote(deltas)` sums what the router sends into `counted`."""

    class _Call:
        def __init__(self, fn):
            self.remote = fn

    def __init__(self, answer):
        self.counted: dict = {}
        self.snapshot = self._Call(lambda since=None, kv_after=None: answer(since))
        self.add_counters = self._Call(self._add)

    def _add(self, deltas):
        for k, v in deltas.items():
            self.counted[k] = self.counted.get(k, 0) + v


def three_pools_snapshot(version=1):
    from keyacc_ray.serve.monitor import Snapshot

    return Snapshot(0.0, {"GpuPrefill": _view("GpuPrefill", "gpu", 8, 40), "GpuDecode": _view("GpuDecode", "gpu", 8, 40),
                          "CpuDecode": _view("CpuDecode", "cpu", 32, 4000)}, version=version)


class RequestCancelledError(Exception):  # what iterating a cancelled Serve stream raises
    pass


class FakeStream:
    """A pool's stream as Serve's DeploymentResponseGenerator behaves: `cancel()` stops it, and
    the reader (waiting or not) gets RequestCancelledError."""

    def __init__(self, gen, cancel_lag: int = 0):
        self.gen = gen
        self.cancelled = False
        self._waiter: asyncio.Future | None = None
        self.cancel_lag = cancel_lag  # items still delivered after cancel(): a cancellation in flight

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.cancelled:
            if self.cancel_lag <= 0:
                raise RequestCancelledError()
            self.cancel_lag -= 1
            return await self.gen.__anext__()
        nxt = asyncio.ensure_future(self.gen.__anext__())
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait({nxt, self._waiter}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            nxt.cancel()
            raise
        if nxt.done():
            return nxt.result()
        nxt.cancel()
        raise RequestCancelledError()

    def cancel(self):
        self.cancelled = True
        if self._waiter is not None and not self._waiter.done() and self.cancel_lag <= 0:
            self._waiter.set_result(None)


class _Subscribe:
    def __init__(self, pool):
        self.pool = pool

    def remote(self, sub):
        return subscription(self.pool.channels, sub, self.pool.name + "-r0", 0.0)


class _Ack(_Subscribe):
    async def remote(self, ack):
        take_ack(self.pool.channels, ack, self.pool.name + "-r0")


class FakePool:
    """Token i of a request is 100 + i, wherever it is generated, so continuity shows."""

    def __init__(self, name: str, pool: str, phase: str):
        self.name, self.pool, self.phase = name, pool, phase
        self.channels: dict = {}  # open multiplexed token streams, by ingress replica
        self.subscribe = _Subscribe(self)
        self.mux_ack = _Ack(self)
        self.calls: list[tuple] = []  # (handoff token count or None, export_after)
        self.fail_after: int | None = None  # raise after this many tokens (once)
        self.fail_with = RuntimeError  # ... this
        self.backpressure = False  # raise BackPressureError (once)
        self.refuse_new = 0  # this many new requests: taken, then refused by the engine's full queue
        self.preempt_after: int | None = None  # a movable sequence is preempted and handed off (once)
        self.movable: list[bool] = []  # what each call was told
        self.start_delay = 0.0  # the next call waits this long before the pool takes it (Serve's queue; once)
        self.receive_delay = 0.0  # ... after taking it, before it says where it runs (the KV import; once)
        # a cancellation of the next call lands only after this many more of its items (once)
        self.cancel_lag = 0
        self.streams: list[FakeStream] = []
        self.generate = self

    def options(self, stream: bool, **kw):
        return self

    def remote(self, req: GenerateRequest, handoff: Handoff | None, export_after: int | None, ticket=None,
               movable=False, mux=None, export_skip=0):
        # a pool that does not check periods itself: it hands off after each one (the driver asks)
        self.calls.append((None if handoff is None else len(handoff.token_ids), export_after))
        self.export_skips = getattr(self, "export_skips", []) + [export_skip]
        self.movable.append(movable)
        if movable and self.preempt_after is not None:
            export_after, self.preempt_after = self.preempt_after, None
        s = FakeStream(self.muxed(self._run(req, handoff, export_after), mux), self.cancel_lag)
        self.cancel_lag = 0
        self.streams.append(s)
        return s

    def muxed(self, gen, mux):
        """As EnginePool.generate: the hop's tokens on the caller's token stream, if it is open."""
        return mux_hop(gen, hop_sender(self.channels, mux))

    async def _run(self, req, handoff, export_after):
        if self.backpressure:  # True: once; a number: that many times
            self.backpressure = False if self.backpressure is True else self.backpressure - 1
            raise BackPressureError("full")
        if self.start_delay:
            delay, self.start_delay = self.start_delay, 0.0
            await asyncio.sleep(delay)
        phase = "decode" if handoff is not None else self.phase
        start = SegmentStart(self.pool, phase, self.name + "-r0", self.name)
        if handoff is None:  # as EnginePool: a new request's acceptance comes with its start
            yield [HopAccepted(), start]
            if self.refuse_new:  # as the engine loop: its add_request raised Overloaded
                self.refuse_new -= 1
                yield [ErrorItem(503, Overloaded("the engine's waiting queue is full (2)").to_dict())]
                return
        else:  # a hand-off's first, then its KV import
            yield [HopAccepted()]
            if self.receive_delay:
                delay, self.receive_delay = self.receive_delay, 0.0
                await asyncio.sleep(delay)
            yield [start]
        done = len(handoff.token_ids) - len(req.prompt_token_ids) if handoff else 0
        max_tokens = req.params["max_tokens"]
        here = 0
        while done < max_tokens:
            await asyncio.sleep(0)
            if self.fail_after is not None and here >= self.fail_after:
                self.fail_after = None
                raise self.fail_with("replica died")
            tok = 100 + done
            done += 1
            here += 1
            last = done == max_tokens
            yield [TokenChunk([tok], f"<{tok}>", "length" if last else None, len(PROMPT), done)]
            if not last and export_after is not None and here >= export_after:
                yield [Handoff(req.request_id, None, [], list(req.prompt_token_ids) + [100 + i for i in range(done)],
                               len(req.prompt_token_ids), req.params, None, 0)]
                return


class CheckingPool(FakePool):
    """A CPU pool as the real one runs periods: with a ticket it keeps decoding, asks the router
    after every period and hands off only when the answer is another hop."""

    router: Router
    checks = 0

    def remote(self, req, handoff, export_after, ticket=None, movable=False, mux=None, export_skip=0):
        if ticket is None:
            return super().remote(req, handoff, export_after, mux=mux)
        self.calls.append((None if handoff is None else len(handoff.token_ids), export_after))
        s = FakeStream(self.muxed(self._periods(req, handoff, export_after, ticket), mux))
        self.streams.append(s)
        return s

    async def _periods(self, req, handoff, period, t):
        yield [SegmentStart(self.pool, "decode" if handoff else self.phase, self.name + "-r0", self.name)]
        done = len(handoff.token_ids) - len(req.prompt_token_ids) if handoff else 0
        here = 0
        while done < req.params["max_tokens"]:
            tok, done, here = 100 + done, done + 1, here + 1
            last = done == req.params["max_tokens"]
            yield [TokenChunk([tok], f"<{tok}>", "length" if last else None, len(PROMPT), done)]
            if not last and period and here % period == 0:
                nt = await self.router.advance(copy.deepcopy(t), HopEnd("handoff", 0.0, done, True, in_place=True))  # as over gRPC
                self.checks += 1
                self.answers = getattr(self, "answers", []) + [nt]
                if nt.hop != t.hop:
                    yield [TicketUpdate(nt), Handoff(req.request_id, None, [], list(req.prompt_token_ids) +
                                                     [100 + i for i in range(done)], len(req.prompt_token_ids),
                                                     req.params, None, 0)]
                    return
                t = nt
                period = nt.export_after  # None: it stays for good, no more checks (as the real pool)
                yield [TicketUpdate(nt)]


def make(policy="gpu_only", options=None, allow_pinning=True, router=None, colocated=False):
    pools = dict(zip(hop_keys(1), [FakePool("GpuPrefill", "gpu", "prefill"), FakePool("GpuDecode", "gpu", "whole"),
                                   FakePool("CpuDecode", "cpu", "whole")]))
    r = router or Router(["CpuDecode"], policy, options, allow_route_pinning=allow_pinning, monitor=_Unreachable(),
                         colocated_gpu=colocated)
    if colocated:  # as build_app: the ingress has no GpuPrefill handle
        gp = pools.pop("gpu_prefill")
        return RequestDriver(r, pools, mux_client(pools)), r, {**pools, "gpu_prefill": gp}
    return RequestDriver(r, pools, mux_client(pools)), r, pools


def mux_client(pools: dict) -> MuxClient | None:
    if not MUX["on"]:
        return None
    return MuxClient("ingress-test", lambda hop, sub: pools[hop].subscribe.remote(sub),
                     lambda hop, ack: pools[hop].mux_ack.remote(ack))


async def warm(driver) -> None:
    """With the mux, open every replica's token stream first (as the first hops there would), so
    that the test's own hops are multiplexed."""
    if driver.mux is None:
        return
    for hop, p in driver.hops.items():
        driver.mux.want(hop, p.name + "-r0")
    for _ in range(3):
        await asyncio.sleep(0)


def request(max_tokens=8, route=None, migrate_back_after=None, rid="r1"):
    return GenerateRequest(rid, list(PROMPT), {"max_tokens": max_tokens}, route, migrate_back_after)


async def collect(driver, req):
    await warm(driver)
    tokens, errors, trace = [], [], None
    async for items in driver.run(req):
        for i in items:
            if isinstance(i, TokenChunk):
                tokens.extend(i.token_ids)
            elif isinstance(i, ErrorItem):
                errors.append(i)
            elif isinstance(i, Trace):
                trace = i.to_dict()
    return tokens, errors, trace


def settled(router: Router) -> bool:
    return not router._active and all(v == 0 for v in router.inflight.values())


def test_gpu_path_prefill_then_decode():
    driver, router, pools = make()
    tokens, errors, trace = asyncio.run(collect(driver, request(8)))
    assert tokens == [100 + i for i in range(8)] and not errors
    assert [(s["pool"], s["phase"], s["tokens"]) for s in trace["segments"]] == [("gpu", "prefill", 1),
                                                                                   ("gpu", "decode", 7)]
    assert pools["gpu_prefill"].calls == [(None, 1)] and pools["gpu_decode"].calls == [(len(PROMPT) + 1, None)]
    assert settled(router)
    assert router._counters["requests_started_total|route=gpu,reason=policy"] == 1


def test_colocated_gpu_engine_serves_both_phases_with_no_hand_off():
    """One GPU engine per GPU (the app's default): a GPU request under gpu_only is one call to
    GpuDecode, prompt in, every token out; GpuPrefill is never called."""
    driver, router, pools = make(colocated=True)
    tokens, errors, trace = asyncio.run(collect(driver, request(8)))
    assert tokens == [100 + i for i in range(8)] and not errors
    assert [(s["deployment"], s["tokens"]) for s in trace["segments"]] == [("GpuDecode", 8)]
    assert pools["gpu_decode"].calls == [(None, None)] and pools["gpu_prefill"].calls == []
    assert settled(router)


def test_colocated_stage_hands_off_after_the_first_token():
    driver, router, pools = make(colocated=True)
    tokens, errors, trace = asyncio.run(collect(driver, request(10, route="stage")))
    assert tokens == [100 + i for i in range(10)] and not errors
    assert [(s["deployment"], s["tokens"]) for s in trace["segments"]] == [("GpuDecode", 1), ("CpuDecode", 9)]
    assert pools["gpu_decode"].calls == [(None, 1)] and pools["cpu_decode/0"].calls == [(len(PROMPT) + 1, None)]
    assert router._counters["moves_total|from=gpu,to=cpu,reason=pinned"] == 1
    assert settled(router)


@pytest.mark.parametrize("overloaded", [False, True])
def test_colocated_decision_after_prefill_is_one_check_and_a_move_only_if_it_moves(overloaded):
    """A policy that places the decode after prefill (stage_offload): the GPU engine checks once
    after the first token, decoding on; staying costs that one call and no hand-off, moving hands
    the sequence to the CPU pool from where it is."""
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100}, colocated=True)
    gpu = CheckingPool("GpuDecode", "gpu", "whole")
    gpu.router = router
    driver.hops["gpu_decode"] = pools["gpu_decode"] = gpu
    if overloaded:
        router.policy.after_prefill = lambda req, load: "cpu"
    tokens, errors, trace = asyncio.run(collect(driver, request(12)))
    assert tokens == [100 + i for i in range(12)] and not errors
    assert gpu.calls == [(None, 1)] and gpu.checks == 1
    if overloaded:
        assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("cpu", 11)]
        assert pools["cpu_decode/0"].calls == [(len(PROMPT) + 1, 100)]
    else:
        assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 12)]
        assert pools["cpu_decode/0"].calls == []
    assert settled(router)


def test_a_move_decided_in_place_leaves_out_the_head_the_router_expects_cached_there():
    """The router records which hop each prompt's head went to (PoolPrefixes): a second request
    with the same 48-token head, moved to the CPU pool by the GPU engine's check, gets the head's
    length in its answer (`kv_skip_tokens`: the export leaves those blocks' K/V out); the first,
    whose head the CPU pool had never seen, gets 0; a request with another head gets 0."""
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100}, colocated=True)
    gpu = CheckingPool("GpuDecode", "gpu", "whole")
    gpu.router = router
    driver.hops["gpu_decode"] = pools["gpu_decode"] = gpu
    router.policy.after_prefill = lambda req, load: "cpu"
    head = list(range(500, 548))
    for i, prompt in enumerate([head + [1] * 8, head + [2] * 8, list(range(900, 956))]):
        req = GenerateRequest(f"r{i}", prompt, {"max_tokens": 6}, None, None)
        tokens, errors, _ = asyncio.run(collect(driver, req))
        assert tokens == [100 + i for i in range(6)] and not errors
    assert [(a.hop, a.kv_skip_tokens) for a in gpu.answers] == [("cpu_decode/0", 0), ("cpu_decode/0", 48),
                                                                ("cpu_decode/0", 0)]
    assert settled(router)


def test_a_hand_off_after_export_after_tokens_leaves_out_what_every_next_hop_caches():
    """Hops that end with a hand-off after `export_after` tokens (a GPU prefill, a pinned route)
    pass `export_skip`: the head every hop the sequence may go to next likely caches (0 while one
    of them has not seen it)."""
    driver, router, pools = make()  # GPU prefill on GpuPrefill, the decode placed after it
    head = list(range(500, 548))

    def run(i, prompt, route=None, migrate_back_after=None):
        req = GenerateRequest(f"r{i}", prompt, {"max_tokens": 6}, route, migrate_back_after)
        tokens, errors, _ = asyncio.run(collect(driver, req))
        assert tokens == [100 + i for i in range(6)] and not errors

    run(0, head + [1] * 8)  # gpu_prefill -> gpu_decode: the CPU pool has not seen the head
    run(1, head + [2] * 8)  # both decode pools? only gpu_decode has it: nothing left out
    run(2, head + [3] * 8, "stage", 3)  # pinned stage: its next hop is the CPU pool, which has not seen it
    run(3, head + [4] * 8, "stage", 3)  # now it has: the prefill's hand-off leaves out the head;
    # and its CPU period's hand-off back to gpu_decode too
    run(4, head + [5] * 8)  # both decode pools have it now
    assert pools["gpu_prefill"].export_skips == [0, 0, 0, 48, 48]
    assert pools["cpu_decode/0"].export_skips == [48, 48]
    assert settled(router)


def test_a_gpu_decode_that_may_be_preempted_to_the_cpu_pool_leaves_out_what_it_caches():
    """Under an offload policy a GPU decode preempted for lack of KV moves to a CPU pool with its
    KV (`movable`): its call carries the head the CPU pools cache, for that export to leave out."""
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100})
    head = list(range(500, 548))
    for i, route in enumerate([None, "cpu", None]):  # the CPU pool runs the head in the second
        req = GenerateRequest(f"r{i}", head + [i] * 8, {"max_tokens": 6}, route, None)
        tokens, errors, _ = asyncio.run(collect(driver, req))
        assert tokens == [100 + i for i in range(6)] and not errors
    assert pools["gpu_decode"].export_skips == [0, 48]
    assert settled(router)


def test_colocated_without_a_router_starts_on_the_gpu_engine():
    from keyacc_ray.serve.driver import fallback

    t = fallback(Ticket("r", 4, 8), None, colocated=True)
    assert (t.hop, t.export_after) == ("gpu_decode", None)
    t = fallback(Ticket("r", 4, 8), None)
    assert (t.hop, t.export_after) == ("gpu_prefill", 1)


def test_pinned_stage_goes_to_cpu_and_back():
    driver, router, pools = make()
    tokens, errors, trace = asyncio.run(collect(driver, request(10, route="stage", migrate_back_after=3)))
    assert tokens == [100 + i for i in range(10)] and not errors
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("cpu", 3), ("gpu", 6)]
    assert pools["cpu_decode/0"].calls == [(len(PROMPT) + 1, 3)]
    assert router._counters["moves_total|from=gpu,to=cpu,reason=pinned"] == 1
    assert router._counters["moves_total|from=cpu,to=gpu,reason=pinned"] == 1
    assert settled(router)


@pytest.mark.parametrize("route, first", [("cpu", [("cpu", 40)]), ("stage", [("gpu", 1), ("cpu", 39)])])
def test_a_pinned_request_stays_where_it_was_pinned_under_an_offload_policy(route, first):
    """A policy's CPU decode periods are for the requests it placed: pinned to the CPU pool
    (without migrate_back_after), a request is not moved back to the GPU after a period (it was,
    after 24 tokens, under every policy with periods)."""
    driver, router, pools = make("full_offload", {"decode_period_tokens": 24})
    tokens, errors, trace = asyncio.run(collect(driver, request(40, route=route)))
    assert tokens == [100 + i for i in range(40)] and not errors
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == first
    assert pools["cpu_decode/0"].calls[-1][1] is None  # no period: nothing to hand off
    assert settled(router)


def test_replica_failure_continues_elsewhere_from_the_tokens_so_far():
    driver, router, pools = make()
    pools["gpu_decode"].fail_after = 2
    tokens, errors, trace = asyncio.run(collect(driver, request(8)))
    assert tokens == [100 + i for i in range(8)] and not errors  # no token lost or repeated
    # prefill 1 + 2 on the GPU decode replica, then the CPU pool from prompt + 3 tokens
    assert pools["cpu_decode/0"].calls == [(len(PROMPT) + 3, None)]
    assert trace["segments"][1].get("failed") is True
    assert router._counters["recoveries_total|hop=gpu_decode"] == 1
    assert settled(router)


def test_full_gpu_decode_queue_moves_the_decode_to_the_cpu_pool():
    driver, router, pools = make()
    pools["gpu_decode"].backpressure = True
    tokens, errors, trace = asyncio.run(collect(driver, request(6)))
    assert tokens == [100 + i for i in range(6)] and not errors
    assert [s["pool"] for s in trace["segments"]] == ["gpu", "cpu"]
    assert router._counters["moves_total|from=gpu,to=cpu,reason=backpressure"] == 1
    assert router._counters["rejected_total|hop=gpu_decode"] == 1
    assert settled(router)


def test_a_stream_under_way_refused_by_a_full_cpu_queue_goes_on_on_the_gpu_and_only_then_gets_a_503(monkeypatch):
    """A decode on its way to the CPU pool (its client has the first token) whose CPU queue is
    full goes on on the GPU decode pool from what the client has, instead of a 503 mid-stream;
    refused there too, it asks the GPU pool again every REFUSED_RETRY_S, and the 503 that cuts
    it comes only after REFUSED_WAIT_S of refusals."""
    from keyacc_ray.serve import driver as driver_mod, router as router_mod

    monkeypatch.setattr(driver_mod, "REFUSED_RETRY_S", 0.05)
    monkeypatch.setattr(router_mod, "REFUSED_WAIT_S", 0.5)
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100})
    router.policy.route = lambda *a: "stage"  # (the policy's decision under load: decode on the CPU)
    pools["cpu_decode/0"].backpressure = True
    tokens, errors, trace = asyncio.run(collect(driver, request(6)))
    assert tokens == [100 + i for i in range(6)] and not errors
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("gpu", 5)]
    assert [c[0] for c in pools["cpu_decode/0"].calls + pools["gpu_decode"].calls] == [len(PROMPT) + 1] * 2
    assert router._counters["moves_total|from=cpu,to=gpu,reason=backpressure"] == 1
    assert router._counters["rejected_total|hop=cpu_decode"] == 1
    assert settled(router)
    pools["cpu_decode/0"].backpressure, pools["gpu_decode"].backpressure = True, 3
    tokens, errors, trace = asyncio.run(collect(driver, request(6, rid="r2")))
    assert tokens == [100 + i for i in range(6)] and not errors  # the GPU's 4th try took it
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("gpu", 5)]
    assert router._counters["moves_total|from=cpu,to=gpu,reason=backpressure"] == 2
    assert router._counters["refused_retries_total|hop=gpu_decode"] == 3
    assert settled(router)
    pools["cpu_decode/0"].backpressure, pools["gpu_decode"].backpressure = True, 10**6
    t0 = time.monotonic()
    tokens, errors, _ = asyncio.run(collect(driver, request(6, rid="r3")))
    assert tokens == [100] and errors[0].status_code == 503 and time.monotonic() - t0 >= 0.5
    assert settled(router)


def test_full_prefill_queue_is_a_503():
    driver, router, pools = make()
    pools["gpu_prefill"].backpressure = True
    tokens, errors, _ = asyncio.run(collect(driver, request(6)))
    assert tokens == [] and errors[0].status_code == 503
    assert errors[0].body["error"]["type"] == "overloaded_error"
    assert settled(router)


def test_a_new_request_refused_by_a_full_engine_queue_goes_where_the_policy_sends_it_next():
    """The router's view was behind and the engine's waiting queue was full: the hop answers
    with the engine's 503. Nothing streamed yet, so the router asks the policy again with that
    pool's queue at its bound: an offload policy sends it to the other pool; `gpu_only`, or the
    other pool refusing too, or a pinned route: the 503, as before."""
    driver, router, pools = make("full_offload", {"trigger_window_s": 0.0})
    router.policy.gpu.flag.state = True  # overloaded: new requests start on the CPU
    pools["cpu_decode/0"].refuse_new = 1
    tokens, errors, trace = asyncio.run(collect(driver, request(6)))
    assert tokens == [100 + i for i in range(6)] and not errors
    assert [(s["pool"], s["tokens"], s.get("refused", False)) for s in trace["segments"]][0] == ("cpu", 0, True)
    assert trace["segments"][-1]["pool"] == "gpu" and sum(s["tokens"] for s in trace["segments"]) == 6
    assert router._counters["requests_rerouted_total|reason=queue_full"] == 1
    assert router._counters["rejected_total|hop=cpu_decode"] == 1
    assert settled(router)
    pools["cpu_decode/0"].refuse_new, pools["gpu_prefill"].refuse_new = 1, 1  # both pools refuse it
    tokens, errors, _ = asyncio.run(collect(driver, request(6, rid="r2")))
    assert tokens == [] and errors[0].status_code == 503 and errors[0].body["error"]["type"] == "overloaded_error"
    assert router._counters["requests_rerouted_total|reason=queue_full"] == 2 and settled(router)
    pools["cpu_decode/0"].refuse_new = 1  # pinned: where it was pinned, or a 503
    tokens, errors, _ = asyncio.run(collect(driver, request(6, rid="r3", route="cpu")))
    assert tokens == [] and errors[0].status_code == 503 and settled(router)
    assert router._counters["requests_rerouted_total|reason=queue_full"] == 2
    driver, router, pools = make()  # gpu_only: the GPU or nothing
    pools["gpu_prefill"].refuse_new = 1
    tokens, errors, _ = asyncio.run(collect(driver, request(6)))
    assert tokens == [] and errors[0].status_code == 503 and settled(router)
    assert "requests_rerouted_total|reason=queue_full" not in router._counters


def test_after_a_full_queue_refused_a_request_the_next_new_ones_go_elsewhere_at_once():
    """The refusal is news the snapshot has not caught up with: for QUEUE_FULL_NEWS_S that hop
    counts at its queue bound, so the next new request goes where the policy sends it past a full
    queue (the GPU) without being refused first; once the news lapses, the snapshot decides
    again (the CPU, here)."""
    from keyacc_ray.serve import router as router_mod

    driver, router, pools = make("full_offload", {"trigger_window_s": 0.0})
    router.policy.gpu.flag.state = True  # overloaded: new requests start on the CPU
    pools["cpu_decode/0"].refuse_new = 1
    _, errors, trace = asyncio.run(collect(driver, request(6)))
    assert not errors and [s["pool"] for s in trace["segments"]][:2] == ["cpu", "gpu"]
    assert router._queue_full.keys() == {"cpu_decode/0"}
    calls = len(pools["cpu_decode/0"].calls)
    tokens, errors, trace = asyncio.run(collect(driver, request(6, rid="r2")))
    assert tokens == [100 + i for i in range(6)] and not errors
    assert trace["segments"][0]["pool"] == "gpu" and not any(s.get("refused") for s in trace["segments"])
    assert len(pools["cpu_decode/0"].calls) == calls  # not tried there
    assert router._counters["rejected_total|hop=cpu_decode"] == 1
    assert router._counters["requests_rerouted_total|reason=queue_full"] == 1
    router._queue_full["cpu_decode/0"] -= router_mod.QUEUE_FULL_NEWS_S  # the news lapsed
    _, errors, trace = asyncio.run(collect(driver, request(6, rid="r3")))
    assert not errors and trace["segments"][0]["pool"] == "cpu" and not router._queue_full
    assert settled(router)


def test_a_refused_new_request_waits_at_the_router_where_the_policy_holds_new_requests():
    """With `max_hold_s`, a new request that a full CPU queue refused while the GPU has no room
    either waits at the router as a new request would (HOLD), instead of the 503, and takes the
    first place that frees once the refusal's news has lapsed."""
    from keyacc_ray.serve import router as router_mod
    from keyacc_ray.serve.monitor import Snapshot

    async def unchanged(since):
        return None

    r = Router(["CpuDecode"], "full_offload", {"trigger_window_s": 30.0, "max_hold_s": 5.0},
               monitor=FakeMonitor(unchanged))
    r.snapshot = Snapshot(0.0, {"GpuPrefill": _view("GpuPrefill", "gpu", 8, 40),
                                "GpuDecode": _view("GpuDecode", "gpu", 8, 40),
                                "CpuDecode": _view("CpuDecode", "cpu", 2, 4000)})

    async def run():
        first = [await r.begin(Ticket(f"b{i}", 64, 96)) for i in range(10)]
        assert [t.route for t in first] == ["gpu"] * 9 + ["cpu"]
        t = await r.begin(Ticket("x", 64, 96))
        assert t.hop == "cpu_decode/0"
        nxt = asyncio.create_task(r.advance(t, HopEnd("backpressure", 0.0, 0)))  # the engine's queue was full
        await asyncio.sleep(0.05)
        assert not nxt.done() and len(r._held) == 1
        assert r._counters["requests_rerouted_total|reason=queue_full"] == 1
        await r.finish(first[9], HopEnd("done", 1.0, 96, finished=True))  # a CPU place frees
        moved = await asyncio.wait_for(nxt, router_mod.QUEUE_FULL_NEWS_S + 2.0)
        assert moved.hop == "cpu_decode/0" and not r._held
        assert r._counters.get("requests_held_total", 0) + r.monitor.counted.get("requests_held_total", 0) == 1

    asyncio.run(run())


def test_pinning_refused_when_turned_off():
    driver, router, _ = make(allow_pinning=False)
    tokens, errors, _ = asyncio.run(collect(driver, request(4, route="cpu")))
    assert tokens == [] and errors[0].status_code == 403
    assert settled(router)


class DeadRouter:
    async def begin(self, t):
        raise ConnectionError("router down")

    advance = begin

    async def finish(self, t, end):
        raise ConnectionError("router down")


def test_router_unreachable_the_driver_decides_alone():
    driver, _, pools = make(router=DeadRouter())
    tokens, errors, trace = asyncio.run(collect(driver, request(5)))
    assert tokens == [100 + i for i in range(5)] and not errors
    assert [s["pool"] for s in trace["segments"]] == ["gpu", "gpu"]


def test_client_gone_cancels_the_pool_stream_and_frees_the_router_count():
    driver, router, pools = make()

    async def go():
        gen = driver.run(request(50, route="cpu"))
        seen = 0
        async for items in gen:
            seen += sum(isinstance(i, TokenChunk) for i in items)
            if seen >= 3:
                break
        await gen.aclose()
        await asyncio.sleep(0.01)  # the router's finish runs as a task
        return seen

    assert asyncio.run(go()) == 3
    assert pools["cpu_decode/0"].streams[0].cancelled
    assert driver.mux is None or not driver.mux._inboxes  # with the token streams: no hop left registered
    assert settled(router)


@pytest.mark.parametrize("n", [5])
def test_concurrent_requests_all_complete_and_settle(n):
    driver, router, _ = make(options=None)

    async def go():
        return await asyncio.gather(*(collect(driver, request(7, route=r, migrate_back_after=2, rid=f"r{i}"))
                                      for i, r in enumerate(["gpu", "cpu", "stage", None, "cpu"][:n])))

    for tokens, errors, _ in asyncio.run(go()):
        assert tokens == [100 + i for i in range(7)] and not errors
    assert settled(router)


def test_any_router_replica_can_take_the_next_call(monkeypatch):
    """The ticket carries the request's routing state: a request begun on one router replica
    goes on through another; the first forgets its count after ACTIVE_TTL_S."""
    from keyacc_ray.serve import router as router_mod

    class TwoRouters:
        def __init__(self):
            self.a = Router(["CpuDecode"], monitor=_Unreachable())
            self.b = Router(["CpuDecode"], monitor=_Unreachable())

        async def begin(self, t):
            return await self.a.begin(t)

        async def advance(self, t, end):
            return await self.b.advance(t, end)

        async def finish(self, t, end):
            await self.b.finish(t, end)

    both = TwoRouters()
    driver, _, _ = make(router=both)
    tokens, errors, trace = asyncio.run(collect(driver, request(6, route="stage", migrate_back_after=2)))
    assert tokens == [100 + i for i in range(6)] and not errors
    assert [s["pool"] for s in trace["segments"]] == ["gpu", "cpu", "gpu"]
    assert settled(both.b) and both.a.inflight["gpu_prefill"] == 1  # a never heard the end
    monkeypatch.setattr(router_mod, "ACTIVE_TTL_S", 0.0)
    both.a._expire()
    assert settled(both.a)


def _view(dep: str, pool: str, max_num_seqs: int, total_blocks: int, replicas: int = 1):
    from keyacc_ray.serve.monitor import DeploymentView

    return DeploymentView(dep, pool, replicas=replicas, max_num_seqs=max_num_seqs, num_total_blocks=total_blocks,
                          num_free_blocks=total_blocks, max_free_blocks=total_blocks // replicas, block_size=16)


def test_router_counts_a_kv_bound_pool_queue_and_a_burst_overflows_past_one_gpu_batch():
    """8 sequence slots but KV for 4 requests of 64 + 96 tokens (10 blocks each of 40): the 5th
    in flight is queued, and a burst overflows to the CPU pool once more than one GPU batch
    waits, without waiting out the trigger window."""
    from keyacc_ray.serve.monitor import Snapshot

    r = Router(["CpuDecode"], "full_offload", {"trigger_window_s": 30.0}, monitor=_Unreachable())
    r.snapshot = Snapshot(0.0, {"GpuPrefill": _view("GpuPrefill", "gpu", 8, 40),
                                "GpuDecode": _view("GpuDecode", "gpu", 8, 40),
                                "CpuDecode": _view("CpuDecode", "cpu", 32, 4000)})
    routes, tickets = [], []

    async def burst():
        from keyacc_ray.serve.messages import HopEnd, Ticket

        for i in range(14):
            t = await r.begin(Ticket(f"b{i}", 64, 96))
            routes.append(t.route)
            tickets.append(t)
        # four prefills hand off to the GPU decode pool (its batch): a request still in prefill
        # needs a decode slot next, so nothing was freed for new requests on the GPU
        for t in tickets[:4]:
            assert (await r.advance(t, HopEnd("handoff", 0.1, 1, has_handoff=True))).hop == "gpu_decode"
        routes.append((await r.begin(Ticket("late", 64, 96))).route)
    asyncio.run(burst())
    view = r.load_view()
    assert view.gpu_prefill.slots == 4 and view.cpu.slots == 32
    # on the GPU: 4 running and 4 queued (one batch) + 1; the rest went to the CPU at once
    assert routes == ["gpu"] * 9 + ["cpu"] * 5 + ["cpu"]
    assert view.gpu_prefill.inflight == 5 and view.gpu_decode.inflight == 4 and view.cpu.queue == 0
    assert r.policy.counters["overflow_to_cpu"] == 6
    r.inflight_tokens["gpu_prefill"] = r.inflight["gpu_prefill"] * 16  # short requests: the slots bind again
    assert r.load_view().gpu_prefill.slots == 8


def test_a_burst_at_a_fresh_router_waits_for_the_first_snapshot():
    """The first decisions of a new router replica wait for its first monitor snapshot (here
    50 ms late): a burst is not routed blind, all to the GPU."""
    from keyacc_ray.serve.messages import Ticket

    async def later(since):
        await asyncio.sleep(0.05)
        return three_pools_snapshot()

    r = Router(["CpuDecode"], "full_offload", {"trigger_window_s": 30.0}, monitor=FakeMonitor(later))

    async def burst():
        ts = await asyncio.gather(*(r.begin(Ticket(f"b{i}", 64, 96)) for i in range(14)))
        return [t.route for t in ts]
    routes = asyncio.run(burst())
    assert routes.count("gpu") == 9 and routes.count("cpu") == 5


def _checking(driver, router):
    pool = CheckingPool("CpuDecode", "cpu", "whole")
    pool.router = router
    driver.hops["cpu_decode/0"] = pool
    asks = []
    advance = router.advance

    async def counted(t, end):
        asks.append(end.num_output_tokens)
        return await advance(t, end)

    router.advance = counted
    pool.router = type("R", (), {"advance": staticmethod(advance)})  # the pool's own calls: not counted
    return pool, asks


def test_cpu_periods_checked_by_the_pool_move_back_without_the_driver_asking_again():
    driver, router, pools = make("full_offload", {"trigger_window_s": 0.0, "decode_period_tokens": 3})
    router.policy.gpu.flag.state = True  # overloaded: the request starts on the CPU
    router.policy.after_period = lambda req, load: "gpu"  # and the first check finds room there
    cpu, asks = _checking(driver, router)
    tokens, errors, trace = asyncio.run(collect(driver, request(10)))
    assert tokens == [100 + i for i in range(10)] and not errors
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("cpu", 3), ("gpu", 7)]
    assert cpu.calls == [(None, 3)]
    assert asks == []  # the pool's check chose the GPU; the driver did not ask again
    assert router._counters["moves_total|from=cpu,to=gpu,reason=return"] == 1
    assert settled(router)


def test_pinned_migrate_back_still_hands_off_after_exactly_n_tokens():
    driver, router, pools = make()
    cpu, asks = _checking(driver, router)
    tokens, errors, trace = asyncio.run(collect(driver, request(10, route="cpu", migrate_back_after=4)))
    assert tokens == [100 + i for i in range(10)] and not errors
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("cpu", 4), ("gpu", 6)]
    assert asks == [4] and settled(router)  # the driver asked at the hand-off, as before


def test_cpu_periods_that_stay_cost_no_hand_off():
    driver, router, pools = make("full_offload", {"trigger_window_s": 0.0})
    router.policy.gpu.flag.state = True  # the GPU is overloaded: new requests and checks stay on the CPU
    cpu, asks = _checking(driver, router)
    n, period = 20, router.policy.decode_period_tokens()
    tokens, errors, trace = asyncio.run(collect(driver, request(n)))
    assert tokens == [100 + i for i in range(n)] and not errors
    assert [(s["pool"], s["tokens"], s["periods"]) for s in trace["segments"]] == [("cpu", n, -(-n // period))]
    assert cpu.calls == [(None, period)]  # one stream for every period: no hand-off, no new call
    assert asks == [] and settled(router)


def test_router_estimates_kv_from_what_requests_really_generate():
    """A request's KV estimate is prompt + max_tokens until the router has seen requests finish;
    then prompt + at most a high quantile of their output lengths (a client without max_tokens
    asks for the whole context). Requests cut short (errors, cancelled) are not counted."""
    from keyacc_ray.serve.messages import HopEnd, Ticket
    from keyacc_ray.serve.monitor import Snapshot

    r = Router(["CpuDecode"], "full_offload", {"trigger_window_s": 30.0}, monitor=_Unreachable())
    r.snapshot = Snapshot(0.0, {"GpuPrefill": _view("GpuPrefill", "gpu", 8, 40),
                                "GpuDecode": _view("GpuDecode", "gpu", 8, 40),
                                "CpuDecode": _view("CpuDecode", "cpu", 32, 4000)})

    async def run():
        a = await r.begin(Ticket("a", 64, 500))  # 564 tokens: 36 of the 40 blocks
        assert r.load_view().gpu_prefill.slots == 1
        for i in range(20):  # cut short: says nothing about output lengths
            await r.finish(Ticket(f"x{i}", 64, 500), HopEnd("done", 0.1, 2))
        assert r.output_lengths.expected() is None
        for i in range(16):
            await r.finish(Ticket(f"f{i}", 64, 500), HopEnd("done", 0.1, 20 + i, finished=True))
        assert r.output_lengths.expected() == 34  # the 90th percentile of 20..35
        await r.finish(a, HopEnd("done", 0.1, 30, finished=True))
        await r.begin(Ticket("b", 64, 500))  # 64 + 34 tokens: 7 blocks
        assert r.load_view().gpu_prefill.slots == 40 // 7
        small = await r.begin(Ticket("c", 64, 10))  # max_tokens below the quantile: its own figure
        assert r._view(small, 0).total_tokens == 74 and r._view(small, 0).expected_output == 34
        assert r._view(Ticket("d", 64, 500), 50).total_tokens == 64 + 50  # past the estimate: what it has
    asyncio.run(run())


def test_a_decode_preempted_on_the_gpu_moves_to_the_cpu_pool_unless_gpu_only_or_pinned():
    """Lazy KV: a GPU decode the engine preempts is handed off with its KV (the pool was told it
    may be, `movable`) and the router sends it on to the CPU pool, where it continues. Under
    gpu_only, or with a pinned route, it is not movable: the engine recomputes it in place."""
    driver, r, pools = make("full_offload", {"trigger_window_s": 30.0})
    pools["gpu_decode"].preempt_after = 3
    tokens, errors, trace = asyncio.run(collect(driver, request(max_tokens=10)))
    assert tokens == list(range(100, 110)) and not errors
    assert [s["deployment"] for s in trace["segments"]] == ["GpuPrefill", "GpuDecode", "CpuDecode"]
    assert pools["gpu_decode"].movable == [True] and pools["gpu_prefill"].movable == [False]
    assert r._counters["gpu_preemptions_moved_total"] == 1
    for policy, route in (("gpu_only", None), ("full_offload", "gpu")):
        driver, r, pools = make(policy)
        pools["gpu_decode"].preempt_after = 3
        tokens, errors, trace = asyncio.run(collect(driver, request(max_tokens=10, route=route)))
        assert tokens == list(range(100, 110)) and pools["gpu_decode"].movable == [False], policy
        assert [s["deployment"] for s in trace["segments"]] == ["GpuPrefill", "GpuDecode"]


def test_without_a_router_a_preempted_gpu_decode_is_recomputed_in_place():
    """The driver's own fallback has no policy to send a preempted decode on: it clears the flag,
    so the GPU pool recomputes it instead of handing it off again and again."""
    from keyacc_ray.serve.driver import fallback
    from keyacc_ray.serve.messages import HopEnd, Ticket

    t = Ticket("r", 4, 10, hop="gpu_decode", move_on_preempt=True)
    nt = fallback(t, HopEnd("handoff", 0.1, 3, True))
    assert nt.hop == "gpu_decode" and not nt.move_on_preempt


class QueuingCpuPool(FakePool):
    """A CPU pool whose requests wait in its queue until told to run; withdrawn while still
    waiting, the stream ends with `Withdrawn` (as AsyncEngine.withdraw does)."""

    def __init__(self):
        super().__init__("CpuDecode", "cpu", "whole")
        self.release = asyncio.Event()
        self.withdrawn: set[str] = set()
        self.waiting: dict[str, asyncio.Event] = {}

    def remote(self, req, handoff, export_after, ticket=None, movable=False, mux=None, export_skip=0):
        self.calls.append((None if handoff is None else len(handoff.token_ids), export_after))
        return FakeStream(self.muxed(self._queued(req, handoff, export_after), mux))

    async def _queued(self, req, handoff, export_after):
        gone = self.waiting[req.request_id] = asyncio.Event()
        yield [SegmentStart(self.pool, self.phase, self.name + "-r0", self.name)]
        await asyncio.wait([asyncio.ensure_future(self.release.wait()), asyncio.ensure_future(gone.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if gone.is_set():
            yield [Withdrawn()]
            return
        async for items in FakePool._run(self, req, handoff, export_after):
            if items := [i for i in items if not isinstance(i, SegmentStart)]:  # (said above)
                yield items

    def withdraw(self, rid):
        self.withdrawn.add(rid)
        self.waiting[rid].set()


def test_requests_queued_on_the_cpu_pool_start_over_on_the_gpu_once_it_has_room():
    """full_offload sent a burst's overflow to the CPU pool, where three wait for a slot. When
    the GPU frees up first, the router's `recall` names as many of them as the GPU has places
    (oldest first); each leaves the CPU queue unstarted (`Withdrawn`), its driver asks again
    and it runs on the GPU: the same tokens, and a trace that shows the withdrawn CPU segment."""
    from keyacc_ray.serve.monitor import Snapshot

    # (not held at the router first: max_hold_s 0, as after a hold that ran out)
    driver, r, pools = make("full_offload", {"trigger_window_s": 30.0, "recall_queued": True, "max_hold_s": 0})
    cpu = pools["cpu_decode/0"] = QueuingCpuPool()
    r.snapshot = Snapshot(0.0, {"GpuPrefill": _view("GpuPrefill", "gpu", 2, 400),
                                "GpuDecode": _view("GpuDecode", "gpu", 2, 400),
                                "CpuDecode": _view("CpuDecode", "cpu", 1, 4000)})

    async def scenario():
        from keyacc_ray.serve.messages import HopEnd

        gpu = [await r.begin(Ticket(f"g{i}", len(PROMPT), 8)) for i in range(5)]  # over one batch waits there
        assert [t.route for t in gpu] == ["gpu"] * 5
        runs = [asyncio.ensure_future(collect(driver, request(8, rid=f"c{i}"))) for i in range(3)]
        for _ in range(1000):
            if len(cpu.waiting) == 3:
                break
            await asyncio.sleep(0)
        assert sorted(cpu.waiting) == ["c0", "c1", "c2"]  # the GPU flooded: overflow to the CPU pool
        tickets = [Ticket(f"c{i}", len(PROMPT), 8, hop="cpu_decode/0") for i in range(3)]
        assert await r.recall(tickets) == []  # the GPU is busy: they stay
        for t in gpu:  # the GPU requests finish: two places free there
            await r.finish(t, HopEnd("done", 1.0, 8, finished=True))
        recalled = await r.recall(tickets)
        assert recalled == ["c0", "c1"]
        assert await r.recall(tickets[2:]) == []  # the two places are taken until c0 and c1 arrive
        assert r.load_view().gpu_prefill.inflight == 2
        for rid in recalled:
            cpu.withdraw(rid)
        cpu.release.set()  # the one left runs on the CPU
        return await asyncio.gather(*runs)

    results = asyncio.run(scenario())
    for i, (tokens, errors, trace) in enumerate(results):
        assert tokens == [100 + j for j in range(8)] and not errors
        pools_ran = [(s["pool"], s["phase"], s.get("withdrawn", False)) for s in trace["segments"]]
        if i < 2:
            assert pools_ran == [("cpu", "whole", True), ("gpu", "prefill", False), ("gpu", "decode", False)]
        else:
            assert pools_ran == [("cpu", "whole", False)]
    assert cpu.withdrawn == {"c0", "c1"} and r.policy.counters["recalled_from_cpu_queue"] == 2
    assert settled(r)
    off = Router(["CpuDecode"], "full_offload", monitor=_Unreachable())  # recall_queued off: pools need not ask
    off.snapshot = r.snapshot
    assert asyncio.run(off.recall([Ticket("c9", len(PROMPT), 8, hop="cpu_decode/0")])) is None


def test_requests_with_no_place_on_either_pool_wait_at_the_router_in_order():
    """full_offload, a GPU batch of 4 (KV-bound) with one batch queued behind it, and a CPU pool
    of 2 slots: once both are full, new requests are held at the router (admitted nowhere) and
    take the places the pools free, oldest first; a held request whose caller goes away leaves
    the line; one held as long as `max_hold_s` queues on a pool."""
    from keyacc_ray.serve.messages import HopEnd, Ticket
    from keyacc_ray.serve.monitor import Snapshot

    async def unchanged(since):  # "nothing changed"; the counters the router sends are kept
        return None
    quiet = FakeMonitor(unchanged)

    r = Router(["CpuDecode"], "full_offload", {"trigger_window_s": 30.0, "max_hold_s": 1.0}, monitor=quiet)
    r.snapshot = Snapshot(0.0, {"GpuPrefill": _view("GpuPrefill", "gpu", 8, 40),
                                "GpuDecode": _view("GpuDecode", "gpu", 8, 40),
                                "CpuDecode": _view("CpuDecode", "cpu", 2, 4000)})

    def counter(name):
        return r._counters.get(name, 0) + quiet.counted.get(name, 0)

    async def run():
        first = [await r.begin(Ticket(f"b{i}", 64, 96)) for i in range(11)]
        assert [t.route for t in first] == ["gpu"] * 9 + ["cpu"] * 2
        held = [asyncio.create_task(r.begin(Ticket(f"h{i}", 64, 96))) for i in range(3)]
        await asyncio.sleep(0.05)
        assert not any(h.done() for h in held) and r.inflight["cpu_decode/0"] == 2
        assert (await r.snapshot_dict())["held"] == 3
        where = {x["request_id"]: x["hop"] for x in r.requests_in_flight(limit=100)}
        assert where == {**{f"b{i}": "gpu_prefill" for i in range(9)}, "b9": "cpu_decode/0", "b10": "cpu_decode/0",
                         **{f"h{i}": "held" for i in range(3)}}
        ages = [x["seconds"] for x in r.requests_in_flight(limit=3)]
        assert len(ages) == 3 and ages == sorted(ages, reverse=True)
        oldest = (await r.snapshot_dict())["oldest_s"]  # /metrics' keyacc_oldest_request_age_seconds
        assert set(oldest) == {"gpu_prefill", "cpu_decode/0", "held"}
        assert oldest["gpu_prefill"] >= oldest["held"] >= 0
        held[1].cancel()  # its client went away: it leaves the line, nothing counted anywhere
        await asyncio.sleep(0)
        await r.finish(first[9], HopEnd("done", 1.0, 96, finished=True))  # a CPU place frees
        await asyncio.sleep(0)
        assert held[0].done() and held[0].result().hop == "cpu_decode/0" and not held[2].done()
        assert held[1].cancelled() and r.inflight["cpu_decode/0"] == 2
        await r.finish(Ticket("h2", 64, 96), HopEnd("done", 0.0, 0))  # its driver's finish, begin never cancelled
        with pytest.raises(asyncio.CancelledError):
            await held[2]
        assert not r._held and r.inflight["cpu_decode/0"] == 2
        late = asyncio.create_task(r.begin(Ticket("late", 64, 96)))
        await asyncio.sleep(0.05)
        assert not late.done()
        t = await asyncio.wait_for(late, 10.0)  # held as long as it may be: it queues on a pool
        assert t.hop in ("gpu_prefill", "cpu_decode/0")
        assert counter("requests_held_total") == 4 and counter("hold_seconds_total") >= 1.0
    asyncio.run(run())


def test_an_idle_router_refreshes_its_snapshot_seldom_and_at_once_when_a_request_comes():
    """With nothing in flight the refresher asks the monitor every REFRESH_IDLE_S (not every
    REFRESH_EVERY_S); a request wakes it at once, and while requests are in flight it refreshes at
    the busy rate again; when they are done it idles again."""
    from keyacc_ray.serve import router as router_mod
    from keyacc_ray.serve.messages import HopEnd, Ticket

    asks: list[float] = []

    async def counted(since):
        asks.append(time.monotonic())
        return three_pools_snapshot(version=len(asks))

    r = Router(["CpuDecode"], "full_offload", {"trigger_window_s": 30.0}, monitor=FakeMonitor(counted))

    async def run():
        await r.snapshot_dict()  # starts the refresher
        await asyncio.sleep(0.6)
        idle_asks = len(asks)
        assert idle_asks == 1, asks  # idle: the first snapshot, then nothing for REFRESH_IDLE_S
        t = await r.begin(Ticket("a", 64, 96))  # a request wakes it
        await asyncio.sleep(0.05)
        assert len(asks) == idle_asks + 1
        await asyncio.sleep(0.5)  # in flight: the busy rate, every REFRESH_EVERY_S
        busy_asks = len(asks) - idle_asks - 1
        assert busy_asks >= 3, asks
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        await asyncio.sleep(0.2)
        settled = len(asks)
        await asyncio.sleep(0.6)
        assert len(asks) == settled, asks  # idle again
        assert r.idle() and router_mod.REFRESH_IDLE_S > 1.0
        await r.snapshot_dict()  # a scrape while idle answers with a snapshot taken for it
        assert len(asks) == settled + 1 and r.snapshot.version == len(asks)
    asyncio.run(run())


@pytest.mark.parametrize("answer", ["cpu_decode/0", "gpu_decode"])
def test_a_period_check_that_crosses_the_requests_end_counts_nothing(answer):
    """The pool's sequence decodes on while its period check is on the way; the request can
    finish and the driver's finish reach the router first. The check then decides nothing: it
    was entered on a hop again (in place or moved) and counted in flight there for good (an e2e
    test saw the router's in-flight counts never settle)."""
    router = make(colocated=True)[1]

    async def run():
        t = await router.begin(Ticket("a", 64, 96))
        assert t.hop == "gpu_decode"
        check = copy.copy(t)  # the pool's copy
        await router.finish(t, HopEnd("done", 0.5, 96, finished=True))
        if answer != "gpu_decode":  # the policy would have moved it
            router.policy.after_prefill = lambda *a: "cpu"
        nt = await router.advance(check, HopEnd("handoff", 0.4, 1, True, in_place=True))
        assert nt.hop == "gpu_decode"  # unchanged: the pool does nothing with it
        assert settled(router) and router._counters["late_checks_total"] == 1
        t2 = await router.begin(Ticket("b", 64, 96))  # other requests are counted as ever
        assert router.inflight["gpu_decode"] == 1 and t2.hop == "gpu_decode"
    asyncio.run(run())


def _monitor_seeing_cpu(alive: bool) -> "FakeMonitor":
    """A monitor whose snapshot shows all three pools, or (not alive) no CPU decode replica."""
    from keyacc_ray.serve.monitor import Snapshot

    async def answer(since):
        snap = three_pools_snapshot()
        if not alive:
            snap = Snapshot(0.0, {k: v for k, v in snap.deployments.items() if k != "CpuDecode"}, version=1)
        return snap
    return FakeMonitor(answer)


@pytest.mark.parametrize("cpu_alive", [True, False])
def test_a_preempted_gpu_decode_stays_on_the_gpu_while_no_cpu_replica_lives(cpu_alive):
    """A GPU decode preempted out of KV moves to the CPU pool, unless the monitor's fresh snapshot
    shows no live CPU decode replica (killed, its replacement starting): there it would wait in
    Serve's queue for the replacement (30 s stalls in the soak), so it waits on the GPU for blocks."""
    r = Router(["CpuDecode"], "full_offload", {}, monitor=_monitor_seeing_cpu(cpu_alive), colocated_gpu=True)

    async def run():
        await r.snapshot_dict()
        t = await r.begin(Ticket("a", 64, 96))
        assert t.hop == "gpu_decode"
        t.prefill_check = False  # past its first token: a preemption, not the after-prefill check
        t = await r.advance(t, HopEnd("handoff", 0.5, 20, True))
        assert t.hop == ("cpu_decode/0" if cpu_alive else "gpu_decode")
        assert r._counters.get("moves_kept_total|reason=cpu_unavailable", 0) == (0 if cpu_alive else 1)
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        assert settled(r)
    asyncio.run(run())



@pytest.mark.parametrize("cpu_alive", [True, False])
def test_a_new_request_for_the_cpu_pool_goes_to_the_gpu_while_no_cpu_replica_lives(cpu_alive):
    """A new request the policy sends to the CPU pool goes to the GPU pool instead while the
    monitor's fresh snapshot shows no live CPU decode replica: Serve's queue for a dead deployment
    waits for the replacement (a pool killed again and again left requests there past their
    clients' timeouts), the GPU pool's queue is bounded. Held requests released to it likewise."""
    r = Router(["CpuDecode"], "full_offload", {}, monitor=_monitor_seeing_cpu(cpu_alive), colocated_gpu=True)
    r.policy.route = lambda *a: "cpu"

    async def run():
        await r.snapshot_dict()
        t = await r.begin(Ticket("a", 64, 96))
        assert t.hop == ("cpu_decode/0" if cpu_alive else "gpu_decode")
        assert r._counters.get("requests_rerouted_total|reason=cpu_unavailable", 0) == (0 if cpu_alive else 1)
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        assert settled(r)
    asyncio.run(run())

def test_a_router_given_its_monitor_keeps_it_when_ray_runs_a_named_one(monkeypatch):
    """A router handed a monitor (tests, the simulator) keeps it when a call to it fails, even
    with Ray up in the same process and a detached monitor of that name alive: it did not look it
    up by name, so it does not look it up again (it did, and sent its counters to the other
    monitor: a unit test failed in the full suite after an e2e test left Ray up)."""
    import ray

    async def answer(since):
        return three_pools_snapshot()

    named = FakeMonitor(answer)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_actor", lambda *a, **k: named)
    router = make()[1]

    async def run():
        t = await router.begin(Ticket("a", 64, 96))
        await asyncio.sleep(0.5)  # in flight: the refresher tries the monitor every REFRESH_EVERY_S
        await router.finish(t, HopEnd("done", 0.5, 96, finished=True))
    asyncio.run(run())
    assert isinstance(router.monitor, _Unreachable) and not named.counted
    assert router._counters["requests_started_total|route=gpu,reason=policy"] == 1


def test_a_router_wait_is_cancelled_even_when_its_event_is_set_at_the_same_moment():
    """The router's bounded waits (the first snapshot, the idle refresher) end on the event or the
    timeout, and a cancellation that meets the event being set still cancels the waiter (Python
    3.11's wait_for could swallow it: a refresher outliving its router, a cancelled begin going on)."""
    from keyacc_ray.serve.router import _wait_at_most

    async def run():
        ev = asyncio.Event()
        t0 = time.monotonic()
        await _wait_at_most(ev, 0.05)  # the timeout
        assert 0.04 <= time.monotonic() - t0 < 1.0 and not ev.is_set()
        ev = asyncio.Event()
        waiter = asyncio.ensure_future(_wait_at_most(ev, 10.0))
        await asyncio.sleep(0)
        ev.set()
        await asyncio.wait_for(waiter, 1.0)  # the event
        for _ in range(20):  # the race: set and cancel in one turn of the loop
            ev = asyncio.Event()
            waiter = asyncio.ensure_future(_wait_at_most(ev, 10.0))
            await asyncio.sleep(0)
            ev.set()
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
    asyncio.run(run())


def test_a_colocated_hop_preempted_before_its_after_prefill_check_answered_goes_where_preempted_decodes_go():
    """One GPU engine for both phases checks with the router after the first token (in place, the
    sequence decoding on). If the engine preempts the sequence first (out of KV blocks), the driver
    reports the hand-off with the ticket still marked `prefill_check`: that is a preemption, and it
    goes to the CPU pool as preempted GPU decodes do, not back to the GPU engine that just ran out
    of blocks (which the policy's after-prefill answer could choose). The pool's own check (in
    place) is the after-prefill decision."""
    r = Router(["CpuDecode"], "stage_offload", {}, monitor=_Unreachable(), colocated_gpu=True)
    r.snapshot = three_pools_snapshot()
    asked = []

    def after_prefill(req, load):
        asked.append(req.num_output_tokens)
        return "gpu"
    r.policy.after_prefill = after_prefill

    async def run():
        t = await r.begin(Ticket("pre", 64, 96))
        assert t.hop == "gpu_decode" and t.prefill_check
        nt = await r.advance(copy.deepcopy(t), HopEnd("handoff", 0.1, 3, True))  # the driver, after a preemption
        assert nt.hop == "cpu_decode/0" and not nt.prefill_check and asked == []
        assert r._counters.get("gpu_preemptions_moved_total") == 1
        t2 = await r.begin(Ticket("chk", 64, 96))
        nt2 = await r.advance(copy.deepcopy(t2), HopEnd("handoff", 0.1, 1, True, in_place=True))  # the pool's check
        assert nt2.hop == "gpu_decode" and asked == [1]
    asyncio.run(run())


def test_a_decode_preempted_on_the_gpu_stays_there_while_the_cpu_pool_has_no_free_place():
    """A GPU decode preempted out of KV blocks moves to the CPU pool only where a place is free
    there; with every CPU slot taken or a queue there it would wait in that queue mid-stream, be
    given up after the driver's bound and come back anyway, so it goes back to the GPU decode
    pool (first in line there: a stream under way), counted as a move kept."""
    r = Router(["CpuDecode"], "full_offload", {}, monitor=_Unreachable())

    async def run():
        got = {}
        for waiting in (0, 3):
            snap = three_pools_snapshot()
            snap.deployments["CpuDecode"].num_waiting = waiting
            r.snapshot = snap
            t = await r.begin(Ticket(f"w{waiting}", 64, 96))
            t = await r.advance(t, HopEnd("handoff", 0.1, 1, True))  # prefill -> a decode hop
            t.hop = "gpu_decode"  # (wherever the policy put it: it decodes on the GPU and is preempted)
            t = await r.advance(copy.deepcopy(t), HopEnd("handoff", 0.1, 5, True))
            got[waiting] = t.hop
        return got
    assert asyncio.run(run()) == {0: "cpu_decode/0", 3: "gpu_decode"}
    assert r._counters.get("moves_kept_total|reason=cpu_full") == 1
    assert r._counters.get("gpu_preemptions_moved_total") == 1


@pytest.mark.parametrize("pinned", [False, True])
def test_a_stalled_decode_start_moves_once_and_a_pinned_one_waits_where_it_was_pinned(monkeypatch, pinned):
    """A decode hop waits in Serve's queue for its replica (dead and being replaced, or full):
    past the driver's bound the call is cancelled and the router sends the stream to the other
    pool, once per request, instead of leaving the client without tokens for as long as that
    takes (issue #23's soak: 31.5 s with the CPU replica killed)."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "HOP_START_BOUND_S", 0.05)
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100})
    router.policy.after_prefill = lambda req, load: "cpu"
    cpu = pools["cpu_decode/0"]
    cpu.start_delay = 0.5
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, request(10, route="stage" if pinned else None)), 4))
    assert not errors and tokens == [100 + i for i in range(10)]
    assert router._counters["stalled_starts_total|hop=cpu_decode"] == 1
    assert cpu.streams[0].cancelled
    if pinned:  # the same pool again, waiting this time up to the longer bound (it takes it by then)
        assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("cpu", 9)]
        assert len(cpu.calls) == 2
    else:
        assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("gpu", 9)]
        assert router._counters["moves_total|from=cpu,to=gpu,reason=stalled"] == 1
    assert router._counters.get("recoveries_total|hop=cpu_decode", 0) == 0  # not a failure
    assert settled(router)


def _never_taken(pool):
    """Every call to `pool` waits in Serve's queue (a deployment whose replicas keep dying)."""
    real = pool._run

    async def run(req, handoff, export_after):
        await asyncio.sleep(60)
        async for items in real(req, handoff, export_after):
            yield items
    pool._run = run


def test_a_pinned_stream_its_pool_never_takes_goes_on_elsewhere(monkeypatch):
    """A pinned stream whose pool does not take it (a node removed: its replicas cannot be placed)
    waits on that pool again up to NEW_HOP_START_BOUND_S, then goes on on the other pool as after
    a failure, not without end (the multi-node test's client timed out there)."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "HOP_START_BOUND_S", 0.05)
    monkeypatch.setattr(driver_mod, "NEW_HOP_START_BOUND_S", 0.2)
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100})
    cpu = pools["cpu_decode/0"]
    _never_taken(cpu)
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, request(10, route="stage")), 4))
    assert not errors and tokens == [100 + i for i in range(10)]
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("gpu", 9)]
    assert len(cpu.calls) == 2 and all(s.cancelled for s in cpu.streams)
    assert router._counters["stalled_starts_total|hop=cpu_decode"] == 2
    assert router._counters["moves_total|from=cpu,to=gpu,reason=stalled"] == 1
    assert settled(router)


def test_a_hop_taken_in_time_is_not_called_stalled_because_the_ingress_loop_ran_late(monkeypatch):
    """The bound is the pool's, not the ingress's: when the ingress's event loop is busy past the
    bound (an ingress at its limit runs timers hundreds of ms late), the replica's first item may
    already be there, unread, when the timer runs; the timer is extended by its lateness instead
    of cancelling a hop that was taken (2x-overload soak: hundreds of such "stalls", each a move
    and a gap)."""
    import time as _time

    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "HOP_START_BOUND_S", 0.2)
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100})
    router.policy.after_prefill = lambda req, load: "cpu"
    cpu = pools["cpu_decode/0"]
    cpu.start_delay = 0.1  # taken after 0.1 s, well within the bound
    real_run = cpu._run

    async def run(req, handoff, export_after):  # the ingress's loop blocked from 0.05 to 0.45 s
        asyncio.get_running_loop().call_later(0.05, _time.sleep, 0.4)
        async for items in real_run(req, handoff, export_after):
            yield items
    cpu._run = run
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, request(10)), 4))
    assert not errors and tokens == [100 + i for i in range(10)]
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("cpu", 9)]
    assert not any(k.startswith("stalled_starts_total") for k in router._counters)
    assert settled(router)


def test_a_hop_cancelled_as_stalled_after_it_streamed_goes_on_from_what_the_client_has(monkeypatch):
    """The stall bound fires just as the hop's replica takes it, and the cancellation lands after
    the hop has streamed tokens: the next hop must go on from every token the client has, not
    from the hand-off that began this hop (the soak's completion of 80 tokens for max_tokens 62,
    a hop's 18 streamed twice)."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "HOP_START_BOUND_S", 0.05)
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100})
    router.policy.after_prefill = lambda req, load: "cpu"
    cpu = pools["cpu_decode/0"]
    cpu.start_delay, cpu.cancel_lag = 0.1, 5  # a few items (tokens among them), then cancelled
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, request(10)), 4))
    assert not errors and tokens == [100 + i for i in range(10)]
    pools_tokens = [(s["pool"], s["tokens"]) for s in trace["segments"]]
    if MUX["on"] and len(pools_tokens) == 2:  # (the hop's tokens come on the token stream, and
        assert pools_tokens == [("gpu", 1), ("cpu", 9)]  # the hop ended before the cancellation)
    else:
        assert [p for p, _ in pools_tokens] == ["gpu", "cpu", "gpu"] and pools_tokens[1][1] >= 1, pools_tokens
        assert trace["segments"][1].get("stalled")
        # the GPU went on from the prompt and every token the client had
        assert pools["gpu_decode"].calls[-1][0] == len(PROMPT) + 1 + pools_tokens[1][1]
    assert settled(router)


def test_a_new_request_or_a_slow_kv_import_is_not_a_stall(monkeypatch):
    """The 1 s bound is for streams under way: a request with no token yet waits for its first
    place longer (NEW_HOP_START_BOUND_S), and a hop its replica took (HopAccepted) may take its
    time importing the KV."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "HOP_START_BOUND_S", 0.05)
    driver, router, pools = make()
    pools["cpu_decode/0"].start_delay = 0.3
    tokens, errors, trace = asyncio.run(collect(driver, request(6, route="cpu")))
    assert tokens == [100 + i for i in range(6)] and [s["pool"] for s in trace["segments"]] == ["cpu"]
    pools["cpu_decode/0"].receive_delay = 0.3
    tokens, errors, trace = asyncio.run(collect(driver, request(6, route="stage", rid="r2")))
    assert tokens == [100 + i for i in range(6)] and [s["pool"] for s in trace["segments"]] == ["gpu", "cpu"]
    assert not any(k.startswith("stalled_starts_total") for k in router._counters)
    assert settled(router)


class ActorUnavailableError(Exception):
    """Ray's, by name (the driver reads the class name, as it does Serve's BackPressureError)."""


@pytest.mark.parametrize("error, replicas, moved_at_once", [(ActorUnavailableError, 1, True), (RuntimeError, 1, False),
                                                        (ActorUnavailableError, 2, False)])
def test_a_hop_failed_with_its_replica_gone_gives_up_the_hops_waiting_there_at_once(error, replicas, moved_at_once):
    """A request's CPU hop waits in Serve's queue (not taken: the replica is dying, its replacement
    20 s away) when another request's hop on the same pool fails with the replica's actor gone:
    the waiting one is given up then, not at its 20 s bound, and starts on the GPU pool (the
    router heard the news too). Another kind of failure leaves it waiting to be taken, and so does
    the death of one of the pool's several replicas (Serve sends it to a live one)."""
    driver, router, pools = make("full_offload")
    driver.replicas = {"cpu_decode/0": replicas}
    router.policy.route = lambda *a: "cpu"
    cpu = pools["cpu_decode/0"]
    cpu.start_delay, cpu.fail_after, cpu.fail_with = 1.5, 2, error

    async def run():
        waiting = asyncio.ensure_future(collect(driver, request(6, rid="waits")))
        await asyncio.sleep(0.05)  # its call is in: the pool sleeps before it takes it
        t0 = time.monotonic()
        tokens, errors, trace = await collect(driver, request(6, rid="fails"))  # fails after 2 tokens
        assert tokens == [100 + i for i in range(6)] and not errors
        assert [s["pool"] for s in trace["segments"]] == ["cpu", "gpu"]  # (failed over from its tokens)
        tokens, errors, trace = await asyncio.wait_for(waiting, 5)
        assert tokens == [100 + i for i in range(6)] and not errors
        return time.monotonic() - t0, trace

    took, trace = asyncio.run(run())
    if moved_at_once:
        assert took < 1.0 and cpu.streams[0].cancelled
        assert {s["pool"] for s in trace["segments"]} == {"gpu"}
        assert router._counters["stalled_starts_total|hop=cpu_decode"] == 1
    else:  # taken when the pool woke, and run there
        assert took >= 1.4 and [s["pool"] for s in trace["segments"]] == ["cpu"]
    assert settled(router)


@pytest.mark.parametrize("cpu_alive", [True, False])
def test_a_new_request_not_taken_by_its_pool_is_routed_again_once(monkeypatch, cpu_alive):
    """A new request the CPU pool's replica does not take within NEW_HOP_START_BOUND_S (Serve's
    queue for a pool whose replicas died and are being replaced: the kill soak lost requests there
    to their clients' timeouts) starts over on the GPU pools, whether or not the monitor still
    shows a live CPU replica (routed back there, it waited without a bound)."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "NEW_HOP_START_BOUND_S", 0.05)
    driver, router, pools = make("full_offload")
    router.policy.route = lambda *a: "cpu"
    seen = []  # the monitor's view of the CPU pool: alive when the request begins; then as the test says
    router._cpu_gone = lambda: bool(seen.append(1) or (len(seen) > 1 and not cpu_alive))
    cpu = pools["cpu_decode/0"]
    cpu.start_delay = 0.5
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, request(6)), 4))
    assert not errors and tokens == [100 + i for i in range(6)]
    assert router._counters["stalled_starts_total|hop=cpu_decode"] == 1 and cpu.streams[0].cancelled
    assert {s["pool"] for s in trace["segments"]} == {"gpu"} and len(cpu.calls) == 1  # (prefill, then decode)
    assert router._counters["moves_total|from=cpu,to=gpu,reason=stalled"] == 1
    assert settled(router)


def test_a_request_goes_to_the_cpu_deployment_that_caches_its_head_unless_it_is_queued():
    """Several CPU decode deployments (NUMA nodes): a request whose prompt's head went to one of
    them goes there too (its prefix cache has it), busier or not, while nothing is queued there;
    a queued one, or a head never seen, the least loaded."""
    from keyacc_ray.serve.monitor import Snapshot

    r = Router(["CpuNode0", "CpuNode1"], "gpu_only", monitor=_Unreachable())
    snap = Snapshot(0.0, {"GpuPrefill": _view("GpuPrefill", "gpu", 8, 40), "GpuDecode": _view("GpuDecode", "gpu", 8, 40),
                          "CpuNode0": _view("CpuNode0", "cpu", 32, 4000), "CpuNode1": _view("CpuNode1", "cpu", 32, 4000)})
    r.snapshot, r.snapshot_age_s = snap, 0.0
    head = list(range(300, 364))

    def enter(rid, prompt):
        return r._enter(Ticket.of(GenerateRequest(rid, prompt, {"max_tokens": 4}, None, None)), "cpu_decode", None)

    r.inflight["cpu_decode/0"] = 3  # node 0 busier
    first = enter("a", head + [1] * 5)
    assert (first.hop, first.kv_skip_tokens) == ("cpu_decode/1", 0)  # never seen: the least loaded
    assert enter("a2", head + [4] * 9).kv_skip_tokens == 0  # (sent there, not yet run there: not cached yet)
    asyncio.run(r.finish(first, HopEnd("done", 0.0, 4, finished=True)))  # ran there
    r.inflight["cpu_decode/1"] += 6  # node 1 now the busier, not queued (32 slots)
    again = enter("b", head + [2] * 9)
    assert (again.hop, again.kv_skip_tokens) == ("cpu_decode/1", 64)  # its head is cached there
    assert enter("c", list(range(700, 790))).hop == "cpu_decode/0"  # another prompt: the least loaded
    snap.deployments["CpuNode1"].num_waiting = 2  # node 1 queued: the least loaded after all
    assert enter("d", head + [3] * 9).hop == "cpu_decode/0"


def test_a_head_that_ran_on_a_pool_sharing_the_node_tier_is_taken_as_cached_by_the_others():
    """Pools whose replicas report one and the same node KV tier: a prompt that ran on the GPU
    pool is cached for the CPU pool too (its engines load it from that tier): the policy's view
    and the hand-off's skip say so. Not where the CPU pool's tier is another machine's, where a
    pool's replicas report several, or where none is reported."""
    from keyacc_ray.serve.monitor import Snapshot

    a, b = "node-a:/dev/shm/keyacc-kv/f1", "node-b:/dev/shm/keyacc-kv/f1"
    cases = [({"GpuDecode": [a], "CpuDecode": [a]}, 64), ({"GpuDecode": [a], "CpuDecode": [b]}, 0),
             ({"GpuDecode": [a], "CpuDecode": [a, b]}, 0), ({"GpuDecode": [""], "CpuDecode": [""]}, 0)]
    for tiers, want in cases:
        r = Router(["CpuDecode"], "gpu_only", monitor=_Unreachable())
        r.take_snapshot(Snapshot(0.0, {}, [{"deployment": d, "replica": f"{d}{i}", "node_tier": x}
                                           for d, xs in tiers.items() for i, x in enumerate(xs)]))
        head = list(range(300, 364))
        t = Ticket.of(GenerateRequest("a", head + [1] * 5, {"max_tokens": 4}, None, None))
        t.hop = "gpu_decode"
        r._ran(t, HopEnd("done", 0.0, 4, finished=True))
        nxt = r._enter(Ticket.of(GenerateRequest("b", head + [2] * 9, {"max_tokens": 4}, None, None)),
                       "cpu_decode", None)
        assert nxt.kv_skip_tokens == want and r._view(nxt, 0).cpu_cached_tokens == want, tiers
        nxt = r._enter(Ticket.of(GenerateRequest("c", head + [2] * 9, {"max_tokens": 4}, None, None)),
                       "gpu_decode", 1)  # (then on to the CPU pool: the export leaves the head out)
        assert nxt.export_skip_tokens == want, tiers


def test_a_pool_whose_replica_left_the_snapshot_is_not_guessed_to_cache_anything():
    from keyacc_ray.serve.monitor import Snapshot

    r = Router(["CpuDecode"], "gpu_only", monitor=_Unreachable())
    t = Ticket.of(GenerateRequest("a", list(range(300, 364)) + [1] * 5, {"max_tokens": 4}, None, None))

    def snap(replicas):
        return Snapshot(0.0, {}, [{"deployment": d, "replica": x} for d, x in replicas])

    r.take_snapshot(snap([("CpuDecode", "c1"), ("GpuDecode", "g1")]))
    for hop in ("cpu_decode/0", "gpu_decode"):
        t.hop = hop
        r._ran(t, HopEnd("done", 0.0, 4, finished=True))
    r.take_snapshot(snap([("CpuDecode", "c1"), ("CpuDecode", "c2"), ("GpuDecode", "g1")]))  # one more: kept
    assert r.prefixes.cached_tokens(t.prefix_keys, t.num_prompt_tokens, "cpu_decode/0") == 64
    r.take_snapshot(snap([("CpuDecode", "c3"), ("GpuDecode", "g1")]))  # c1 and c2 gone
    assert r.prefixes.cached_tokens(t.prefix_keys, t.num_prompt_tokens, "cpu_decode/0") == 0
    assert r.prefixes.cached_tokens(t.prefix_keys, t.num_prompt_tokens, "gpu_decode") == 64


def test_a_stream_moved_by_a_stall_to_a_cpu_pool_that_never_takes_it_goes_back_to_the_gpu(monkeypatch):
    """A GPU decode hop of a stream under way not taken within the bound moves to the CPU pool;
    a CPU pool that does not take it either (replicas killed while they start: alive to the
    monitor between deaths, Serve's queue waiting for a replacement) sends it back to the GPU
    pool after NEW_HOP_START_BOUND_S, where it waits its turn: never without a bound on the CPU
    pool (the kill soak's lost requests: 120 s client timeouts in that queue)."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "HOP_START_BOUND_S", 0.05)
    monkeypatch.setattr(driver_mod, "NEW_HOP_START_BOUND_S", 0.2)
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100})
    router.policy.after_prefill = lambda req, load: "gpu"
    gpu, cpu = pools["gpu_decode"], pools["cpu_decode/0"]
    gpu.start_delay = 0.3  # the first call waits in a full GPU pool's queue
    _never_taken(cpu)
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, request(10)), 4))
    assert not errors and tokens == [100 + i for i in range(10)]
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("gpu", 1), ("gpu", 9)]
    assert len(gpu.calls) == 2 and len(cpu.calls) == 1 and cpu.streams[0].cancelled
    assert router._counters["stalled_starts_total|hop=gpu_decode"] == 1
    assert router._counters["stalled_starts_total|hop=cpu_decode"] == 1
    assert router._counters["moves_total|from=gpu,to=cpu,reason=stalled"] == 1
    assert router._counters["moves_total|from=cpu,to=gpu,reason=stalled"] == 1
    assert settled(router)


@pytest.mark.parametrize("case", ["cpu_full", "cpu_has_room", "gpu_replica_silent", "pinned"])
def test_a_stream_its_live_pool_is_slow_to_take_waits_there_while_the_other_pool_is_full(monkeypatch, case):
    """A GPU decode hop of a stream under way not taken within the bound (its replica alive but
    slow to start the call: an overloaded replica's event loop) while the CPU pool is full: the
    router tells the driver to wait on for it, bound after bound, instead of moving the stream
    into the CPU pool's queue (the 2x soak: 12-13 s gaps there). It moves as before where the CPU
    pool has a place, where the GPU replica has not reported for LIVE_REPORT_S (killed), or where
    the stream is pinned (that rule is its own)."""
    from keyacc_ray.serve import driver as driver_mod
    from keyacc_ray.serve.router import LIVE_REPORT_S

    monkeypatch.setattr(driver_mod, "HOP_START_BOUND_S", 0.05)
    monkeypatch.setattr(driver_mod, "NEW_HOP_START_BOUND_S", 2.0)
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 100})
    router.policy.after_prefill = lambda req, load: "gpu"
    snap = three_pools_snapshot()
    snap.time_s = 50.0
    snap.deployments["CpuDecode"].num_waiting = 0 if case == "cpu_has_room" else 3
    age = 3 * LIVE_REPORT_S if case == "gpu_replica_silent" else 0.1
    snap.replicas = [{"deployment": "GpuDecode", "replica": "g1", "time_s": 50.0 - age},
                     {"deployment": "CpuDecode", "replica": "c1", "time_s": 50.0}]
    router.take_snapshot(snap)
    gpu, cpu = pools["gpu_decode"], pools["cpu_decode/0"]
    gpu.start_delay = 0.4  # taken after eight bounds
    req = request(10, route="gpu" if case == "pinned" else None)
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, req), 4))
    assert not errors and tokens == [100 + i for i in range(10)]
    segments = [(s["pool"], s["tokens"]) for s in trace["segments"]]
    if case == "cpu_full":
        assert segments == [("gpu", 1), ("gpu", 9)] and len(gpu.calls) == 1 and not cpu.calls
        assert not gpu.streams[0].cancelled
        assert router._counters["stalls_waited_total|hop=gpu_decode"] >= 3
        assert not any(k.startswith("stalled_starts_total") for k in router._counters)
    else:
        assert gpu.streams[0].cancelled and router._counters["stalled_starts_total|hop=gpu_decode"] == 1
        assert not any(k.startswith("stalls_waited_total") for k in router._counters)
        if case != "pinned":
            assert segments == [("gpu", 1), ("cpu", 9)]
    assert settled(router)


def test_a_cpu_hop_slow_to_be_taken_waits_on_while_the_gpu_has_no_room_and_the_router_must_answer(monkeypatch):
    """`keep_waiting`'s other side: a CPU decode hop waits on while the GPU decode pool has no
    place for it and the CPU replica reports; not once the GPU has room, nor for a new request's
    first hop (not a stream under way: its own rule). A driver whose router does not answer within
    KEEP_ASK_S gives the call up as before."""
    from keyacc_ray.serve import driver as driver_mod

    r = Router(["CpuDecode"], "full_offload", {}, monitor=_Unreachable(), colocated_gpu=True)
    snap = three_pools_snapshot()
    snap.time_s = 7.0
    snap.replicas = [{"deployment": "CpuDecode", "replica": "c1", "time_s": 6.9}]
    snap.deployments["GpuDecode"].num_waiting = 2
    r.take_snapshot(snap)
    t = Ticket("a", 64, 96)
    t.hop = "cpu_decode/0"
    assert asyncio.run(r.keep_waiting(t))
    snap.deployments["GpuDecode"].num_waiting = 0
    r.take_snapshot(snap)
    assert not asyncio.run(r.keep_waiting(t))
    t.hop = "gpu_prefill"
    assert not asyncio.run(r.keep_waiting(t))

    class Slow:
        async def keep_waiting(self, t):
            await asyncio.sleep(5)
            return True

    async def ask():
        stream = FakeStream(_forever())
        waiting = {"rearms": 0, "timer": None, "keep": lambda: Slow().keep_waiting(t), "since": 0.0}
        await driver_mod._keep_or_give_up(stream, waiting, waiting["keep"])
        return stream.cancelled, waiting["stalled"]
    monkeypatch.setattr(driver_mod, "KEEP_ASK_S", 0.05)
    assert asyncio.run(ask()) == (True, True)


async def _forever():
    await asyncio.sleep(60)
    yield []


@pytest.mark.parametrize("cpu_alive", [True, False])
def test_a_stalled_gpu_decode_stays_on_the_gpu_while_no_cpu_replica_lives(cpu_alive):
    """A stream whose GPU decode hop was not taken in time goes to the CPU pool, unless the
    monitor's fresh snapshot shows no live CPU decode replica: then it waits its turn on the GPU
    pool (whose queue is bounded), not in Serve's queue for a dead CPU deployment."""
    r = Router(["CpuDecode"], "full_offload", {}, monitor=_monitor_seeing_cpu(cpu_alive), colocated_gpu=True)

    async def run():
        await r.snapshot_dict()
        t = await r.begin(Ticket("a", 64, 96))
        t.prefill_check = False
        t = await r.advance(t, HopEnd("stalled", 1.0, 12, True))
        assert t.hop == ("cpu_decode/0" if cpu_alive else "gpu_decode") and t.stall_moved
        assert r._counters.get("moves_kept_total|reason=cpu_unavailable", 0) == (0 if cpu_alive else 1)
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        assert settled(r)
    asyncio.run(run())


def _monitor_with_replicas(replicas: list) -> "FakeMonitor":
    """A monitor whose snapshot shows all three pools alive, with `replicas` (read at each call)."""
    async def answer(since):
        snap = three_pools_snapshot()
        snap.replicas = [{"deployment": d, "replica": x} for d, x in replicas]
        return snap
    return FakeMonitor(answer)


async def new_hop(r: Router, rid: str) -> str:
    """Where the router starts a new request now (the request then leaves at once)."""
    t = await r.begin(Ticket(rid, 64, 96))
    r._leave(t, HopEnd("done", 0.0, 0))
    return t.hop


def test_a_pool_whose_hop_stalled_is_gone_for_every_move_until_it_shows_it_takes_calls(monkeypatch):
    """A CPU hop not taken in time (its replica just died, while the monitor still shows it for
    STALE_AFTER_S) is fresher news than the snapshot: the policy's moves there (new requests, a
    preempted GPU decode) stay on the GPU until a hop ends there after running, the snapshot shows
    a replica not seen at the stall (the replacement), or STALL_MEMORY_S passed (the kill soak: a
    policy move to a CPU pool whose replica had died waited 17 s in Serve's queue). Only the hop
    right after a stall waits for its pool up to NEW_HOP_START_BOUND_S."""
    from keyacc_ray.serve import router as router_mod

    now = [100.0]
    replicas = [("CpuDecode", "c1"), ("GpuDecode", "g1")]
    r = Router(["CpuDecode"], "full_offload", {}, monitor=_monitor_with_replicas(replicas), colocated_gpu=True,
               clock=lambda: now[0])
    r.policy.route = lambda *a: "cpu"

    async def stall_a_cpu_stream(rid):
        t = Ticket(rid, 64, 96)
        r._enter(t, "cpu_decode", 8)
        t = await r.advance(t, HopEnd("stalled", 1.0, 12, True))
        assert t.hop == "gpu_decode" and t.stall_moved  # this hop: the longer bound
        return t

    async def run():
        await r.snapshot_dict()
        assert await new_hop(r, "before") == "cpu_decode/0"
        t = await stall_a_cpu_stream("a")
        assert await new_hop(r, "b") == "gpu_decode"
        assert r._counters["requests_rerouted_total|reason=cpu_unavailable"] == 1
        # the stream moved by the stall checks in on the GPU pool: its next hop has the short bound
        t = await r.advance(t, HopEnd("handoff", 0.5, 20, True))  # preempted there: kept on the GPU
        assert t.hop == "gpu_decode" and not t.stall_moved
        assert r._counters["moves_kept_total|reason=cpu_unavailable"] == 1
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        # a CPU hop that ends after running (a request already there): the pool takes calls
        c = Ticket("c", 64, 96)
        r._enter(c, "cpu_decode", None)
        await r.finish(c, HopEnd("done", 2.0, 96, finished=True))
        assert await new_hop(r, "d") == "cpu_decode/0"
        # the replacement in the snapshot
        await r.finish(await stall_a_cpu_stream("e"), HopEnd("done", 0.5, 96, finished=True))
        assert await new_hop(r, "f") == "gpu_decode"
        await r.snapshot_dict()  # the same replica: still gone
        assert await new_hop(r, "g") == "gpu_decode"
        replicas[0] = ("CpuDecode", "c2")
        await r.snapshot_dict()
        assert await new_hop(r, "h") == "cpu_decode/0"
        # or the memory's end
        await r.finish(await stall_a_cpu_stream("i"), HopEnd("done", 0.5, 96, finished=True))
        now[0] += router_mod.STALL_MEMORY_S - 1
        assert await new_hop(r, "j") == "gpu_decode"
        now[0] += 2
        assert await new_hop(r, "k") == "cpu_decode/0"
        assert settled(r)
    asyncio.run(run())


@pytest.mark.parametrize("error, gone", [("ActorUnavailableError", True), ("ActorDiedError", True),
                                          ("RuntimeError", False)])
def test_a_hop_failed_with_its_replica_gone_is_news_of_its_pool_as_a_stall_is(error, gone):
    """A CPU hop that failed because its replica's actor died (killed: the monitor shows it alive
    for STALE_AFTER_S more) sends the policy's new requests to the GPU pool, as a stall there does,
    until the replacement shows in the snapshot (the 2x kill soak: they waited 20 s in Serve's
    queue for it, and past its bound got a 503). Another failure is not news of the replica."""
    replicas = [("CpuDecode", "c1"), ("GpuDecode", "g1")]
    r = Router(["CpuDecode"], "full_offload", {}, monitor=_monitor_with_replicas(replicas), colocated_gpu=True)
    r.policy.route = lambda *a: "cpu"

    async def run():
        await r.snapshot_dict()
        t = Ticket("a", 64, 96)
        r._enter(t, "cpu_decode", 8)
        t = await r.advance(t, HopEnd("failed", 0.2, 5, True, error))
        assert t.hop == "gpu_decode"  # the stream itself fails over, either way
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        assert await new_hop(r, "b") == ("gpu_decode" if gone else "cpu_decode/0")
        replicas[0] = ("CpuDecode", "c2")  # the replacement, in the router's next snapshot
        await asyncio.sleep(3 * REFRESH_EVERY_S)
        await r.snapshot_dict()
        assert await new_hop(r, "c") == "cpu_decode/0"
        assert settled(r)
    asyncio.run(run())


def test_a_replica_dying_after_a_streams_last_token_ends_the_request_not_a_recovery():
    """The replica dies after the request's last token reached the client but before its hop
    ended: the request is complete (its finish reason came with that token); going on elsewhere
    from every token it may make was refused by the next engine ("no tokens left to generate")
    and cut the stream with an error."""
    driver, router, pools = make("full_offload")
    router.policy.route = lambda *a: "cpu"
    cpu = pools["cpu_decode/0"]
    real_run = type(cpu)._run

    async def die_after_the_last(self, req, handoff, export_after):
        async for items in real_run(self, req, handoff, export_after):
            yield items
        raise ActorUnavailableError("replica died")

    cpu._run = die_after_the_last.__get__(cpu)
    tokens, errors, trace = asyncio.run(collect(driver, request(6)))
    assert tokens == [100 + i for i in range(6)] and not errors
    assert [s["pool"] for s in trace["segments"]] == ["cpu"] and len(pools["gpu_decode"].calls) == 0
    assert settled(router)


@pytest.mark.parametrize("gpu_replicas", [1, 2])
def test_one_of_several_gpu_replicas_dying_leaves_the_gpu_pool_serving(gpu_replicas):
    """A GPU decode hop fails with its replica's actor gone. With another live replica of the GPU
    deployment that has a place, the stream goes on there and the policy's new requests still
    start on the GPU (it was the GPU pool's "gone" for up to STALL_MEMORY_S: every new request and
    move to the CPU pool, with the other GPUs idle); once every replica of it died, or with one
    replica only, the stream and new requests go to the CPU pool."""
    replicas = [("CpuDecode", "c0")] + [("GpuDecode", f"g{i}") for i in range(gpu_replicas)]
    r = Router(["CpuDecode"], "full_offload", {}, monitor=_monitor_with_replicas(replicas), colocated_gpu=True)
    r.policy.route = lambda *a: "gpu"

    async def fail_on(rid: str, replica: str) -> str:
        t = Ticket(rid, 64, 96)
        r._enter(t, "gpu_decode", None)
        t = await r.advance(t, HopEnd("failed", 0.2, 5, True, "ActorDiedError", replica=replica))
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        return t.hop

    async def run():
        await r.snapshot_dict()
        on = "gpu_decode" if gpu_replicas > 1 else "cpu_decode/0"
        assert await fail_on("a", "g0") == on
        assert await new_hop(r, "b") == on
        if gpu_replicas > 1:  # the other one dies too (the snapshot still shows both): the pool is gone
            assert await fail_on("c", "g1") == "cpu_decode/0"
            assert await new_hop(r, "d") == "cpu_decode/0"
        assert r._counters.get("requests_rerouted_total|reason=gpu_unavailable", 0) == 1
        assert settled(r)
    asyncio.run(run())


def test_streams_of_a_dead_gpu_replica_fail_over_to_the_other_while_its_blocks_last():
    """A GPU replica dies under two streams at once; the other replica's free blocks hold one of
    them: the first goes on there (its blocks counted as taken at once), the second on the CPU."""
    from keyacc_ray.serve.monitor import Snapshot

    async def answer(since):
        snap = three_pools_snapshot()
        snap = Snapshot(0.0, {**snap.deployments, "GpuDecode": _view("GpuDecode", "gpu", 16, 40, replicas=2)},
                        version=1)
        snap.replicas = [{"deployment": d, "replica": x} for d, x in
                         (("CpuDecode", "c0"), ("GpuDecode", "g0"), ("GpuDecode", "g1"))]
        return snap
    r = Router(["CpuDecode"], "full_offload", {}, monitor=FakeMonitor(answer), colocated_gpu=True)

    async def run():
        await r.snapshot_dict()
        ts = [Ticket(rid, 64, 200) for rid in ("a", "b")]  # 17 blocks each; 20 free on one replica
        for t in ts:
            r._enter(t, "gpu_decode", None)
        hops = [(await r.advance(t, HopEnd("failed", 0.2, 5, True, "ActorDiedError", replica="g0"))).hop
                for t in ts]
        assert hops == ["gpu_decode", "cpu_decode/0"]
        for t in ts:
            await r.finish(t, HopEnd("done", 0.5, 200, finished=True))
        assert settled(r)
    asyncio.run(run())


def two_cpu_deployments_router(replicas: list | None = None) -> Router:
    """A full_offload router (its policy sends new requests to the CPU pool) over a CPU decode
    deployment per NUMA node, CpuDecode0 and CpuDecode1, every pool alive in the monitor's snapshot
    (with `replicas`: (deployment, replica) pairs)."""
    from keyacc_ray.serve.monitor import Snapshot

    async def answer(since):
        snap = three_pools_snapshot()
        cpu = snap.deployments.pop("CpuDecode")
        snap = Snapshot(0.0, {**snap.deployments, "CpuDecode0": cpu, "CpuDecode1": cpu}, version=1)
        snap.replicas = [{"deployment": d, "replica": x} for d, x in replicas or ()]
        return snap
    r = Router(["CpuDecode0", "CpuDecode1"], "full_offload", {}, monitor=FakeMonitor(answer), colocated_gpu=True)
    r.policy.route = lambda *a: "cpu"
    return r


def test_a_stream_whose_cpu_replica_died_goes_on_on_another_live_cpu_deployment():
    """With a CPU decode deployment per NUMA node, a stream whose CPU replica died goes on on the
    other node's deployment where it has a place (the GPU pool takes it only when no CPU node does),
    and new requests the policy sends to the CPU pool go there too."""
    r = two_cpu_deployments_router([("CpuDecode0", "c0"), ("CpuDecode1", "c1"), ("GpuDecode", "g0")])

    async def run():
        await r.snapshot_dict()
        t = Ticket("a", 64, 96)
        r._enter(t, "cpu_decode/0", 8)
        t = await r.advance(t, HopEnd("failed", 0.2, 5, True, "ActorDiedError", replica="c0"))
        assert t.hop == "cpu_decode/1"
        for i in range(3):
            assert await new_hop(r, f"n{i}") == "cpu_decode/1"
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        assert settled(r)
    asyncio.run(run())


def test_a_stall_on_one_cpu_deployment_sends_moves_to_another_not_to_the_gpu():
    """With a CPU decode deployment per NUMA node, one whose hop stalled is passed over while
    another is live; the CPU pool as a whole is not gone."""
    r = two_cpu_deployments_router()

    async def run():
        await r.snapshot_dict()
        t = Ticket("a", 64, 96)
        r._enter(t, "cpu_decode", 8)
        stalled_on = t.hop
        t = await r.advance(t, HopEnd("stalled", 1.0, 12, True))
        for i in range(3):  # (the other would be the less loaded one anyway after the first)
            n = await r.begin(Ticket(f"n{i}", 64, 96))
            assert n.hop.startswith("cpu_decode/") and n.hop != stalled_on
        assert not r._counters.get("requests_rerouted_total|reason=cpu_unavailable")
    asyncio.run(run())


def test_a_stream_moved_off_a_stalled_gpu_pool_is_not_sent_back_there_by_the_policy(monkeypatch):
    """A stream whose GPU decode hop stalled decodes on the CPU pool; at the end of its CPU period
    the policy would move it back to the GPU (the monitor still shows the GPU replica), but no GPU
    decode hop ran since the stall: it decodes on where it is instead of waiting for a dead
    replica's queue again."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "HOP_START_BOUND_S", 0.05)
    driver, router, pools = make("stage_offload", {"decode_period_tokens": 4})
    router.policy.after_prefill = lambda req, load: "gpu"
    router.policy.after_period = lambda req, load: "gpu"
    gpu = pools["gpu_decode"]
    _never_taken(gpu)
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, request(14)), 4))
    assert not errors and tokens == [100 + i for i in range(14)]
    assert [s["pool"] for s in trace["segments"]] == ["gpu", "cpu"] and len(gpu.calls) == 1
    assert router._counters["stalled_starts_total|hop=gpu_decode"] == 1
    assert router._counters["moves_kept_total|reason=gpu_unavailable"] >= 2
    assert settled(router)


def test_a_new_request_the_gpu_pool_never_takes_goes_on_on_the_cpu_pool(monkeypatch):
    """A new request waits for the GPU pool's replica to take it at most NEW_HOP_START_BOUND_S
    (its replica killed while starting, again and again: the GPU kill soak's client timed out
    after 120 s there), then starts on the CPU pool: generate()'s tokens, nothing counted after."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "NEW_HOP_START_BOUND_S", 0.1)
    driver, router, pools = make("gpu_only", colocated=True)
    _never_taken(pools["gpu_decode"])
    tokens, errors, trace = asyncio.run(asyncio.wait_for(collect(driver, request(6)), 4))
    assert not errors and tokens == [100 + i for i in range(6)]
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("cpu", 6)]
    assert router._counters["stalled_starts_total|hop=gpu_decode"] == 1
    assert router._counters["moves_total|from=gpu,to=cpu,reason=stalled"] == 1
    assert settled(router)


def test_a_request_no_pool_takes_gets_a_503_not_a_wait_without_end(monkeypatch):
    """Neither pool takes the request (both keep dying): after MAX_STALLS hops not taken in time
    the client gets a clear 503, never a wait past its timeout; nothing counted after. The same
    when the router cannot be reached (the driver decides alone)."""
    from keyacc_ray.serve import driver as driver_mod

    monkeypatch.setattr(driver_mod, "NEW_HOP_START_BOUND_S", 0.05)
    for dead_router in (False, True):
        driver, router, pools = make("gpu_only", colocated=True, router=DeadRouter() if dead_router else None)
        for hop in ("gpu_decode", "cpu_decode/0"):
            _never_taken(pools[hop])
        tokens, errors, _ = asyncio.run(asyncio.wait_for(collect(driver, request(6)), 4))
        assert tokens == [] and len(errors) == 1 and errors[0].status_code == 503
        assert len(pools["gpu_decode"].calls) + len(pools["cpu_decode/0"].calls) == driver_mod.MAX_STALLS + 1
        if not dead_router:
            assert router._counters["stalled_starts_total|hop=gpu_decode"] + \
                router._counters["stalled_starts_total|hop=cpu_decode"] == driver_mod.MAX_STALLS + 1
            assert settled(router)


def _monitor_seeing_gpu(alive: bool) -> "FakeMonitor":
    """A monitor whose snapshot shows all three pools, or (not alive) no GPU replica."""
    from keyacc_ray.serve.monitor import Snapshot

    async def answer(since):
        snap = three_pools_snapshot()
        if not alive:
            snap = Snapshot(0.0, {k: v for k, v in snap.deployments.items() if not k.startswith("Gpu")}, version=1)
        return snap
    return FakeMonitor(answer)


@pytest.mark.parametrize("gpu_alive", [True, False])
def test_while_no_gpu_replica_lives_new_requests_start_and_stalled_streams_stay_on_the_cpu_pool(gpu_alive):
    """`_cpu_gone`'s twin: a new request the policy sends to the GPU pool starts on the CPU pool
    while the monitor shows no live GPU replica and the CPU pool has a free place, and a CPU stream not taken in time stays on the
    CPU pool instead of moving into Serve's queue for the dead GPU deployment. (`gpu_only`, the
    baseline, routes by no snapshot.)"""
    base = Router(["CpuDecode"], "gpu_only", {}, monitor=_monitor_seeing_gpu(gpu_alive), colocated_gpu=True)
    r = Router(["CpuDecode"], "full_offload", {}, monitor=_monitor_seeing_gpu(gpu_alive), colocated_gpu=True)
    r.policy.route = lambda *a: "gpu"

    async def run():
        await base.snapshot_dict()
        assert (await base.begin(Ticket("z", 64, 96))).hop == "gpu_decode"
        await r.snapshot_dict()
        t = await r.begin(Ticket("a", 64, 96))
        assert t.hop == ("gpu_decode" if gpu_alive else "cpu_decode/0")
        assert r._counters.get("requests_rerouted_total|reason=gpu_unavailable", 0) == (0 if gpu_alive else 1)
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        r.inflight["cpu_decode/0"] += 32  # the CPU pool full (the GPU's streams under way went there):
        assert (await r.begin(Ticket("full", 64, 96))).hop == "gpu_decode"  # a new one waits for the GPU pool
        r._leave(Ticket("full", 64, 96), HopEnd("done", 0.0, 0))
        r.inflight["cpu_decode/0"] -= 32
        t = Ticket("b", 64, 96, hop="cpu_decode/0")
        r._enter(t, "cpu_decode", None)
        t = await r.advance(t, HopEnd("stalled", 1.0, 12, True))
        assert t.hop == ("gpu_decode" if gpu_alive else "cpu_decode/0") and t.stall_moved
        assert r._counters.get("moves_kept_total|reason=gpu_unavailable", 0) == (0 if gpu_alive else 1)
        await r.finish(t, HopEnd("done", 0.5, 96, finished=True))
        assert settled(r)
    asyncio.run(run())


def test_the_engines_news_of_where_a_head_is_drives_the_view_and_the_hand_off_skip():
    """The engines tell (through the monitor's log) which tier holds the blocks at a prompt's
    anchors: the router takes that over its guess, per replica: a head the CPU pool's engine let
    go of is not left out of a hand-off there (the guess alone still said cached); one pushed down
    to its host tier still is, and the policy's view carries the time to load it at the bandwidth
    that pool measured; news from a replica gone from the snapshot is void; a log the router
    missed part of leaves it its guesses only."""
    from keyacc_ray.engine.blocks import chain_hashes
    from keyacc_ray.serve.monitor import Snapshot

    head = list(range(300, 300 + 8 * 16))
    keys = chain_hashes([], head, 16)  # what an engine with 16-token blocks keys the head by
    replicas = [{"deployment": "CpuDecode", "replica": "c1", "block_size": 16,
                 "kv_tiers": {"block_bytes": 8192, "tiers": {"host": {"bandwidth": 8192 * 100.0}}}},
                {"deployment": "GpuDecode", "replica": "g1"}]

    def snap(events, version, complete=True, reps=replicas):
        return Snapshot(0.0, {}, reps, version=version, kv_events=events, kv_log=(7, version), kv_complete=complete)

    def told(tier, depths=(1, 2, 4, 8), replica="c1"):
        return [("CpuDecode", replica, keys[d - 1], tier) for d in depths]

    r = Router(["CpuDecode"], "gpu_only", monitor=_Unreachable())
    r.take_snapshot(snap([], 1))
    first = Ticket.of(GenerateRequest("a", head + [1] * 5, {"max_tokens": 4}, None, None))
    first.hop = "cpu_decode/0"
    r._ran(first, HopEnd("done", 0.0, 4, finished=True))  # the guess: it ran there
    nxt = lambda i: Ticket.of(GenerateRequest(f"n{i}", head + [2] * 9, {"max_tokens": 4}, None, None))  # noqa: E731
    assert r._enter(nxt(0), "cpu_decode/0", None).kv_skip_tokens == 128
    r.take_snapshot(snap(told(""), 2))  # the engine let go of all of it
    assert r._enter(nxt(1), "cpu_decode/0", None).kv_skip_tokens == 0 and r._view(nxt(1), 0).cpu_cached_tokens == 0
    r.take_snapshot(snap(told("device", (1, 2)) + told("host", (4, 8)), 3))
    view = r._view(nxt(2), 0)
    assert r._enter(nxt(2), "cpu_decode/0", None).kv_skip_tokens == 128 and view.cpu_cached_tokens == 128
    # 96 tokens past the two blocks in its pool: 6 blocks of 8192 bytes at 100 blocks a second
    assert abs(view.cpu_cached_load_s - 0.06) < 1e-9
    assert r._view(Ticket.of(GenerateRequest("x", [5] * 100, {"max_tokens": 4}, None, None)), 0).cpu_cached_load_s == 0
    assert r.prefixes.cached(nxt(3).prefix_keys, nxt(3).num_prompt_tokens, "cpu_decode/0") == (128, 32, "host")
    r.take_snapshot(snap([], 4, reps=replicas[1:]))  # c1 gone: what it told is void (and the guess forgotten)
    assert r._view(nxt(4), 0).cpu_cached_tokens == 0
    r.take_snapshot(snap(told("device", replica="c2"), 5, reps=[{**replicas[0], "replica": "c2"}, replicas[1]]))
    assert r._view(nxt(5), 0).cpu_cached_tokens == 128
    r.take_snapshot(snap([], 6, complete=False))  # some news missed: guesses only
    assert r._view(nxt(6), 0).cpu_cached_tokens == 0
    assert r._kv_place == (7, 6)


def test_the_load_time_of_a_head_in_a_lower_tier_counts_against_the_cpu_prefill_limit():
    from keyacc_ray.policies import LoadView, PoolLoad, RequestView, make_policy
    from keyacc_ray.policies.hysteresis import cpu_prefill_fits

    p = make_policy("auto", {"cpu_prefill_max_s": 1.0})
    load = LoadView(PoolLoad(), PoolLoad(), PoolLoad(prefill_tokens_per_s=1000.0))
    req = lambda load_s: RequestView(1500, 0, 16, cpu_cached_tokens=800, cpu_cached_load_s=load_s)  # noqa: E731
    assert cpu_prefill_fits(p, req(0.0), load)  # 0.7 s to compute the rest
    assert not cpu_prefill_fits(p, req(0.5), load)  # + 0.5 s to load the head from its tier
    # never more than computing it (the engine computes what is cheaper): 0.7 + 0.8 s
    assert not cpu_prefill_fits(p, req(9.0), load) and cpu_prefill_fits(
        make_policy("auto", {"cpu_prefill_max_s": 1.5}), req(9.0), load)


def test_the_remote_router_gets_the_finishes_of_requests_ending_together_in_one_call():
    """`finish` is bookkeeping nobody waits for: an ingress replica sends the finishes of the
    requests ending within FINISH_GATHER_S of each other as one router call (each call costs the
    router and the ingress about a millisecond of CPU), later ones in the next call; a failed call
    is logged, not raised; a gather cancelled (the ingress going away) leaves the next finish to
    start a new one."""
    from keyacc_ray.serve.driver import FINISH_GATHER_S, RemoteRouter

    class Handle:
        def __init__(self):
            self.calls, self.fail = [], False
            self.finish_many = self

        def options(self, **kw):
            return self

        async def remote(self, ends):
            if self.fail:
                raise ConnectionError("router restarting")
            self.calls.append([t.request_id for t, _ in ends])

    async def run():
        h = Handle()
        rr = RemoteRouter(h)
        end = HopEnd("done", 0.1, 3, finished=True)
        await asyncio.gather(*(rr.finish(Ticket(f"a{i}", 8, 8), end) for i in range(5)))
        await rr.finish(Ticket("b", 8, 8), end)
        h.fail = True
        await rr.finish(Ticket("lost", 8, 8), end)  # (the router's count of it expires there)
        h.fail = False
        task = asyncio.ensure_future(rr.finish(Ticket("cancelled", 8, 8), end))
        await asyncio.sleep(FINISH_GATHER_S / 4)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await rr.finish(Ticket("c", 8, 8), end)
        return h.calls
    assert asyncio.run(run()) == [["a0", "a1", "a2", "a3", "a4"], ["b"], ["c"]]


def test_the_router_finishes_many_as_it_finishes_each():
    r = Router(["CpuDecode"], "gpu_only", {}, monitor=_Unreachable())
    r.snapshot = three_pools_snapshot()

    async def run():
        a, b = await r.begin(Ticket("a", 16, 8)), await r.begin(Ticket("b", 16, 8))
        busy = sum(r.inflight.values())
        await r.finish_many([(a, HopEnd("done", 0.1, 8, finished=True)), (b, HopEnd("done", 0.1, 8, finished=True))])
        return busy, sum(r.inflight.values())
    assert asyncio.run(run()) == (2, 0)
    assert settled(r)


def test_a_burst_past_the_cpu_pools_queue_bound_queues_on_the_gpu_instead_of_being_refused():
    """The replicas tell the monitor their waiting-queue bound (`max_waiting`): a burst that the
    policy sends to the CPU pool goes on to the GPU's queue once the router's own count puts the
    CPU's queue at its bound (sent there, the engine would refuse it: a 503)."""
    from keyacc_ray.serve.monitor import Snapshot

    r = Router(["CpuDecode"], "full_offload", {"trigger_window_s": 30.0}, monitor=_Unreachable())
    cpu = _view("CpuDecode", "cpu", 4, 4000)
    cpu.max_waiting = 3
    gpu = _view("GpuDecode", "gpu", 8, 40)
    gpu.max_waiting = 64
    r.snapshot = Snapshot(0.0, {"GpuPrefill": _view("GpuPrefill", "gpu", 8, 40), "GpuDecode": gpu, "CpuDecode": cpu})
    routes = []

    async def burst():
        from keyacc_ray.serve.messages import Ticket

        for i in range(20):
            routes.append((await r.begin(Ticket(f"b{i}", 64, 96))).route)
    asyncio.run(burst())
    assert r.load_view().cpu.queue_bound == 3
    # 9 on the GPU (its batch of 4, 4 queued and one), then the CPU pool's 4 slots and 3 queued,
    # then the GPU's queue again, not a CPU queue past its bound
    assert routes == ["gpu"] * 9 + ["cpu"] * 7 + ["gpu"] * 4, routes
    assert r.policy.counters["queue_bound_to_gpu"] == 4


@pytest.mark.parametrize("fault", [False, True])
def test_each_segment_after_the_first_says_when_the_hop_before_it_ended(fault):
    """prev_end_ms: when the hop before a segment ended at the ingress (a hand-off, or a failure),
    so that prev_end_ms..sent_ms is the router's answer; in order with the other timings."""
    driver, router, pools = make()
    if fault:
        pools["gpu_decode"].fail_after = 2
    tokens, errors, trace = asyncio.run(collect(driver, request(10, route="stage" if not fault else None,
                                                                migrate_back_after=3 if not fault else None)))
    segs = trace["segments"]
    assert tokens == [100 + i for i in range(10)] and not errors and len(segs) >= 3
    assert "prev_end_ms" not in segs[0] and all("prev_end_ms" in s for s in segs[1:])
    for a, b in zip(segs, segs[1:]):
        assert a["first_token_ms"] <= b["prev_end_ms"] <= b["sent_ms"] <= b["start_ms"] <= b["first_token_ms"]
    if fault:  # the GPU decode hop failed after its 2 tokens, and went on on the CPU pool
        assert segs[1]["failed"] and segs[1]["tokens"] == 2 and segs[2]["pool"] == "cpu"
    else:  # prefill on the GPU, 3 tokens on the CPU, back to the GPU
        assert [s["pool"] for s in segs] == ["gpu", "cpu", "gpu"]
