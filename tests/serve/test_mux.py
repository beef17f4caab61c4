"""The multiplexed token streams (serve/mux.py) without Ray: the driver's MuxClient, the pools'
muxing code and its subscription, in one event loop; every driver test in test_driver.py also
runs with them. The end-to-end tests run the same code through Serve (the app's default)."""
from __future__ import annotations

import asyncio
import time
import dataclasses
import pickle

import pytest

from keyacc_ray.serve import mux as mux_mod
from keyacc_ray.serve.messages import SegmentStart, TokenChunk
from keyacc_ray.serve.mux import (Channel, HopSender, Inbox, MuxClient, Subscribe, hop_sender, mux_hop,
                                  subscription)
from tests.serve.test_driver import MUX, collect, make, request, settled


@pytest.fixture
def muxed():
    MUX["on"] = True
    yield
    MUX["on"] = False


def _tok(i, last=False):
    return TokenChunk([i], f"<{i}>", "length" if last else None)


def test_inbox_puts_runs_back_in_order_and_ends_at_the_total():
    async def go():
        box = Inbox()
        box.muxed = True
        box.run(2, [_tok(3)])
        box.run(0, [SegmentStart("gpu", "whole", "r", "D")])
        box.end(4)  # the call's MuxEnd can come before the tokens
        first = await box.get()
        assert type(first[0]) is SegmentStart
        box.run(1, [_tok(1), _tok(2)])
        got = await box.get()  # runs 1 and 2, consecutive chunks merged into one
        assert [type(i) for i in got] == [TokenChunk] and got[0].token_ids == [1, 2, 3]
        box.run(1, [_tok(99)])  # a run seen already: ignored
        box.run(3, [_tok(4, last=True)])
        assert (await box.get())[0].token_ids == [4]
        assert await box.get() is None

    asyncio.run(go())


def test_inbox_raises_the_calls_error_after_what_came_before_and_fails_a_hop_whose_tokens_are_lost(monkeypatch):
    async def go():
        box = Inbox()
        box.plain([_tok(1)])
        box.fail(RuntimeError("replica died"))
        assert (await box.get())[0].token_ids == [1]
        with pytest.raises(RuntimeError):
            await box.get()
        monkeypatch.setattr(mux_mod, "LOST_AFTER_S", 0.05)
        box = Inbox()
        box.muxed = True
        box.run(0, [_tok(1)])
        box.end(3)
        box.end()  # the call ended; runs 1 and 2 never come
        await box.get()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(box.get(), 2)

    asyncio.run(go())


def test_runs_late_on_a_stream_still_open_are_waited_for_and_lost_once_it_ends(monkeypatch):
    """A hop whose call ended waits for its last runs past LOST_AFTER_S while the token stream
    that carries them is still open (an ingress too loaded to read it at its pace: they are late,
    not lost), up to LATE_LIMIT_S; once that stream has ended, LOST_AFTER_S after the call's end."""
    monkeypatch.setattr(mux_mod, "LOST_AFTER_S", 0.05)
    monkeypatch.setattr(mux_mod, "LATE_LIMIT_S", 0.5)

    async def go():
        state = {"open": True}
        box = Inbox()
        box.muxed, box.source, box.source_open = True, ("gpu_decode", "r"), lambda: state["open"]
        box.run(0, [_tok(1)])
        box.end(2)
        await box.get()
        asyncio.get_running_loop().call_later(0.2, box.run, 1, [_tok(2, last=True)])  # 4x LOST_AFTER_S late
        assert (await asyncio.wait_for(box.get(), 2))[0].token_ids == [2]
        assert await box.get() is None

        box = Inbox()
        box.muxed, box.source, box.source_open = True, ("gpu_decode", "r"), lambda: state["open"]
        box.run(0, [_tok(1)])
        box.end(3)
        await box.get()
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):  # open, but nothing for LATE_LIMIT_S
            await asyncio.wait_for(box.get(), 2)
        assert 0.4 <= time.monotonic() - t0 < 1.5

        box = Inbox()
        box.muxed, box.source, box.source_open = True, ("gpu_decode", "r"), lambda: state["open"]
        box.run(0, [_tok(1)])
        box.end(3)
        await box.get()

        def stream_ends():
            state["open"] = False
            box._wake.set()  # as MuxClient does when the subscription ends
        asyncio.get_running_loop().call_later(0.1, stream_ends)  # past LOST_AFTER_S: lost as it ends
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(box.get(), 2)
        assert 0.05 <= time.monotonic() - t0 < 0.4

    asyncio.run(go())


def test_a_cancelled_inbox_wait_is_cancelled_even_when_its_tokens_arrive_in_the_same_turn():
    """The driver of a client that went away is cancelled while it waits for a hop's last runs;
    the runs arriving in the same turn of the loop must not swallow the cancellation (Python
    3.11's asyncio.wait_for returns the result then, and the driver would go on)."""
    async def go():
        box = Inbox()
        box.muxed = True
        box.run(0, [_tok(1)])
        box.end(2)
        box.end()  # the call ended: the wait for run 1 is the bounded one
        await box.get()
        task = asyncio.get_running_loop().create_task(box.get())
        for _ in range(3):
            await asyncio.sleep(0)
        box.run(1, [_tok(2)])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_wait_at_most_keeps_a_cancellation_that_meets_the_result_and_times_out():
    from keyacc_ray.serve.aio import wait_at_most

    async def go():
        fut = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(wait_at_most(fut, 5))
        for _ in range(3):
            await asyncio.sleep(0)
        fut.set_result(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(asyncio.TimeoutError):
            await wait_at_most(asyncio.Event().wait(), 0.01)
        assert await wait_at_most(asyncio.sleep(0, "x"), 1) == "x"

    asyncio.run(go())


def test_mux_hop_sends_token_runs_to_the_channel_and_the_rest_on_the_call_numbered_in_one_sequence():
    async def go():
        ch = Channel(0.0)

        async def hop():
            yield [SegmentStart("cpu", "decode", "r", "D")]
            yield [_tok(1), _tok(2)]
            yield ["update", _tok(3), "handoff"]

        out = [items async for items in mux_hop(hop(), HopSender(ch, 7))]
        assert ch._buf == [(7, 1, [_tok(1), _tok(2)]), (7, 3, [_tok(3)])]
        own = [i for items in out for i in items]
        assert [(type(i).__name__, getattr(i, "seq", None)) for i in own] == [
            ("MuxRun", 0), ("MuxRun", 2), ("MuxRun", 4), ("MuxEnd", None)]
        assert own[-1].total == 5 and ch.active == 0
        # without a channel (or a closed one), the hop is what it was
        ch.close()
        plain = [items async for items in mux_hop(hop(), hop_sender({"i": ch}, ("i", 8)))]
        assert plain[1] == [_tok(1), _tok(2)]

    asyncio.run(go())


def test_a_subscription_reaching_another_replica_ends_at_once_and_an_idle_one_closes(monkeypatch):
    async def go():
        channels: dict = {}
        assert [b async for b in subscription(channels, Subscribe("i", "other"), "me", 0.0)] == []
        monkeypatch.setattr(mux_mod, "IDLE_CLOSE_S", 0.05)
        ch_seen = []

        async def sub():
            return [b async for b in subscription(channels, Subscribe("i", "me"), "me", 0.0)]

        task = asyncio.ensure_future(sub())
        await asyncio.sleep(0)
        ch_seen.append(channels["i"])
        channels["i"].put(1, 0, [_tok(1)])
        got = await asyncio.wait_for(task, 2)  # idle after the batch: it closes by itself
        assert [pickle.loads(b)[2] for b in got] == [[(1, 0, [_tok(1)])]] and "i" not in channels and ch_seen[0].closed

    asyncio.run(go())


def test_the_first_hop_on_a_replica_subscribes_and_the_next_hops_ride_the_token_stream(muxed):
    driver, router, pools = make()

    async def go():
        first = await collect_cold(driver, request(6, route="cpu", rid="a"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert driver.mux.subscriptions == 1 and driver.mux.batches == 0
        second = await collect_cold(driver, request(6, route="cpu", rid="b"))
        return first, second

    first, second = asyncio.run(go())
    assert first == second == [100 + i for i in range(6)]
    assert driver.mux.batches > 0 and not driver.mux._inboxes
    assert settled(router)


async def collect_cold(driver, req):
    tokens = []
    async for items in driver.run(req):
        tokens += [t for i in items if isinstance(i, TokenChunk) for t in i.token_ids]
    return tokens


@pytest.mark.parametrize("route, segments", [("stage", [("gpu", 1), ("cpu", 3), ("gpu", 6)]),
                                             ("gpu", [("gpu", 1), ("gpu", 9)])])
def test_hand_offs_across_multiplexed_hops_keep_every_token_in_order(muxed, route, segments):
    driver, router, pools = make()
    tokens, errors, trace = asyncio.run(collect(driver, request(10, route=route, migrate_back_after=3)))
    assert tokens == [100 + i for i in range(10)] and not errors
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == segments
    assert driver.mux.batches > 0 and not driver.mux._inboxes
    assert all(ch.active == 0 for p in pools.values() for ch in p.channels.values())
    assert settled(router)


def test_a_token_stream_closed_mid_hop_sends_the_rest_on_the_hops_own_call(muxed):
    driver, router, pools = make()
    cpu = pools["cpu_decode/0"]
    real_run = type(cpu)._run

    async def run_then_close(self, req, handoff, export_after):
        async for items in real_run(self, req, handoff, export_after):
            yield items
            if any(isinstance(i, TokenChunk) and i.num_output_tokens == 4 for i in items):
                for ch in list(self.channels.values()):
                    ch.close()

    cpu._run = run_then_close.__get__(cpu)
    tokens, errors, trace = asyncio.run(collect(driver, request(12, route="cpu")))
    assert tokens == [100 + i for i in range(12)] and not errors
    assert [(s["pool"], s["tokens"]) for s in trace["segments"]] == [("cpu", 12)]
    assert settled(router)


def test_a_token_stream_lost_mid_hop_fails_the_hop_and_it_goes_on_elsewhere_from_the_tokens_so_far(muxed):
    """The ingress's end of a replica's token stream breaks while the replica still runs the
    hop: the hop fails (its call is cancelled there) and the request continues on the other
    pool from the tokens the client has, as for a replica that died."""
    driver, router, pools = make()
    gpu = pools["gpu_decode"]
    real_run = type(gpu)._run
    state = {"n": 0}

    async def run_and_break(self, req, handoff, export_after):
        async for items in real_run(self, req, handoff, export_after):
            yield items
            state["n"] += 1
            if state["n"] == 4:
                for task in list(driver.mux._subs.values()):
                    task.cancel()
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)

    gpu._run = run_and_break.__get__(gpu)
    tokens, errors, trace = asyncio.run(collect(driver, request(10)))
    assert tokens == [100 + i for i in range(10)] and not errors  # none lost, none repeated
    assert any(s.get("failed") for s in trace["segments"])
    assert gpu.streams[0].cancelled
    assert settled(router)


class ActorDiedError(Exception):  # what Ray raises where a replica's actor died (matched by name)
    pass


@pytest.mark.parametrize("error, news", [(ActorDiedError, True), (RuntimeError, False)])
def test_a_token_stream_broken_by_its_replicas_death_fails_the_hop_with_that_news(muxed, error, news):
    """A replica's token stream breaks with its actor gone before the hop's own call says so:
    the hop fails as a replica death (ReplicaGoneError), which the router takes as news of the
    pool (a plain break, as before: a ConnectionError, no news). Either way it goes on elsewhere
    with every token once."""
    driver, router, pools = make()
    gpu = pools["gpu_decode"]
    real_run, real_subscribe = type(gpu)._run, gpu.subscribe.remote
    state = {"n": 0, "dead": False}

    async def dying(sub):
        async for batch in real_subscribe(sub):
            yield batch
            if state["dead"]:
                raise error("the replica's actor died")

    async def run_and_die(self, req, handoff, export_after):
        async for items in real_run(self, req, handoff, export_after):
            yield items
            state["n"] += 1
            state["dead"] = state["dead"] or state["n"] == 4
            await asyncio.sleep(0)

    gpu.subscribe.remote = dying
    gpu._run = run_and_die.__get__(gpu)
    tokens, errors, trace = asyncio.run(collect(driver, request(10)))
    assert tokens == [100 + i for i in range(10)] and not errors
    assert any(s.get("failed") for s in trace["segments"])
    assert router._stalled_lately("gpu_decode") is news
    assert settled(router)


@pytest.mark.parametrize("never_ends", [False, True])
def test_a_hop_read_whole_before_its_calls_end_leaves_the_call_to_end_by_itself(muxed, monkeypatch, never_ends):
    """Every run and the MuxEnd of a hop read before its call's own end arrives: the driver is
    done with it, and the call is left to end by itself (cancelling it cost a cancellation RPC and
    the replica's cancellation path: 21 of 64 requests against the default app), within
    CALL_END_WAIT_S; a call that never ends is cancelled then."""
    monkeypatch.setattr(mux_mod, "CALL_END_WAIT_S", 0.2)
    driver, router, pools = make()
    cpu = pools["cpu_decode/0"]
    real = type(cpu).muxed
    seen = {"ended": 0, "cancelled": 0}

    async def late_end(gen):
        async for items in gen:
            yield items
        try:
            await asyncio.sleep(30 if never_ends else 0.05)  # the call's end, after its MuxEnd
            seen["ended"] += 1
        except asyncio.CancelledError:
            seen["cancelled"] += 1
            raise

    async def go():
        await collect_cold(driver, request(6, route="cpu", rid="a"))  # (the first hop subscribes)
        await asyncio.sleep(0.05)
        cpu.muxed = lambda gen, mux: late_end(real(cpu, gen, mux))
        before = dict(seen)
        got = await collect_cold(driver, request(6, route="cpu", rid="b"))
        assert seen == before  # the request is done; its call not cancelled meanwhile
        await asyncio.sleep(0.5)
        return got, before

    got, before = asyncio.run(go())
    assert got == [100 + i for i in range(6)] and driver.mux.batches > 0
    assert seen["ended"] - before["ended"] == (0 if never_ends else 1)
    assert seen["cancelled"] - before["cancelled"] == (1 if never_ends else 0)
    assert not driver.mux._inboxes and settled(router)


def test_the_request_router_sends_a_subscription_to_the_replica_it_names():
    pytest.importorskip("ray.serve")
    from keyacc_ray.serve.request_router import _target

    class R:
        def __init__(self, uid):
            self.replica_id = type("Id", (), {"unique_id": uid})()

    class Pending:
        def __init__(self, args):
            self.args = args

    reps = [R("a"), R("b"), R("c")]
    assert _target(reps, Pending((Subscribe("i", "b"),))) == [[reps[1]]]
    assert _target(reps, Pending((Subscribe("i", "gone"),))) == [reps]  # any: it refuses, the ingress asks later
    assert _target(reps, Pending(("a request",))) is None and _target(reps, None) is None


@pytest.mark.parametrize("cls", ["MuxRouter", "PrefixAffinityRouter"])
def test_calls_queued_for_a_full_replica_go_control_first_then_streams_under_way_then_new_requests(cls):
    """UnderWayFirst over Ray's own RequestRouter: the next call to route is the first subscription
    or ack waiting (not one already done), else the first hop that comes with a hand-off (a stream
    under way), else the oldest call as Serve picks it."""
    pytest.importorskip("ray.serve")
    import collections

    from ray.serve._private.request_router.request_router import RequestRouter

    from keyacc_ray.serve import request_router
    from keyacc_ray.serve.messages import GenerateRequest, Handoff
    from keyacc_ray.serve.mux import MuxAck

    assert hasattr(RequestRouter, "_get_next_pending_request_to_route")  # (Ray's private method it overrides)

    class Pending:
        def __init__(self, *args, done=False):
            self.args = args
            self.future = type("F", (), {"done": lambda self: done})()

    def hop(i, moved=False):
        req = GenerateRequest(f"r{i}", [1, 2, 3], {"max_tokens": 4})
        return Pending(req, Handoff(req.request_id, None, [], [1, 2, 3, 9], 3, {}, None, 0) if moved else None, None)

    r = object.__new__(getattr(request_router, cls))
    new = [hop(i) for i in range(3)]
    moved, moved_done = hop(7, moved=True), Pending(*hop(8, moved=True).args, done=True)
    done_ack, ack, sub = Pending(MuxAck("i", "a", 16), done=True), Pending(MuxAck("i", "a", 32)), Pending(
        Subscribe("i", "b"))
    r._pending_requests_to_route = collections.deque([new[0], moved_done, done_ack, new[1], moved, ack, sub, new[2]])
    order = [r._get_next_pending_request_to_route() for _ in range(6)]
    assert order == [ack, sub, moved, new[0], new[1], new[2]] and r._get_next_pending_request_to_route() is None
    assert [request_router.priority(x) for x in (sub, ack, moved, new[0], Pending())] == [0, 0, 1, 2, 2]


def test_mux_client_does_not_ask_a_refusing_replica_again_at_once():
    async def go():
        calls = []

        async def refuse(hop, sub):
            calls.append(sub)
            return
            yield  # an empty stream: the call reached another replica

        c = MuxClient("i", refuse)
        c.want("cpu_decode/0", "x")
        await asyncio.sleep(0.01)
        c.want("cpu_decode/0", "x")
        await asyncio.sleep(0.01)
        return calls

    assert len(asyncio.run(go())) == 1


def test_a_token_chunk_pickles_as_its_fields():
    c = TokenChunk([1, 2], "ab", "stop", 5, 2, [(-0.1, [(1, -0.1)])], [None, (-1.0, [])], 3)
    back = pickle.loads(pickle.dumps(c))
    assert back == c and dataclasses.astuple(back) == dataclasses.astuple(c)
    assert len(pickle.dumps(c)) < len(pickle.dumps(dataclasses.asdict(c)))


def test_a_pool_sends_at_most_a_window_of_unread_batches_and_gathers_tokens_meanwhile(monkeypatch):
    """Flow control: an ingress replica that reads slowly gets fewer, bigger batches (as a slow
    reader of one stream per hop got bigger chunks), not an ever longer backlog; with no ack for
    ACK_WAIT_S, the next batch goes anyway."""
    monkeypatch.setattr(mux_mod, "ACK_WAIT_S", 30.0)  # (a slow machine's loop: no batch by timeout here)

    async def go():
        ch = Channel(0.0)
        got = []

        async def reader():
            async for batch in ch.batches():
                got.append(batch)

        task = asyncio.ensure_future(reader())
        for i in range(mux_mod.WINDOW * 3):
            ch.put(1, i, [_tok(i)])
            await asyncio.sleep(0.002)
        assert len(got) == mux_mod.WINDOW  # no ack: the rest waits, gathered
        ch.ack(mux_mod.WINDOW)
        await asyncio.sleep(0.01)
        assert len(got) == mux_mod.WINDOW + 1 and len(got[-1]) == mux_mod.WINDOW * 2
        assert [seq for b in got for _, seq, _ in b] == list(range(mux_mod.WINDOW * 3))
        mux_mod.ACK_WAIT_S = 0.05  # the window is full again: no ack, and the next batch goes after this
        for i in range(mux_mod.WINDOW):
            ch.put(1, 100 + i, [_tok(i)])
            await asyncio.sleep(0.002)
        n = len(got)
        ch.put(1, 200, [_tok(0)])
        await asyncio.sleep(0.3)
        assert len(got) == n + 1 and got[-1][-1][1] == 200
        ch.close()
        await asyncio.wait_for(task, 2)

    asyncio.run(go())


def test_the_ingress_acks_what_it_read(muxed):
    driver, router, pools = make()
    n = mux_mod.WINDOW * 2 + 8  # (tokens: more batches than a window)

    async def go():
        tokens, errors, trace = await collect(driver, request(n, route="cpu"))
        await asyncio.sleep(0.01)
        (ch,) = pools["cpu_decode/0"].channels.values()
        return tokens, ch.sent, ch.acked

    tokens, sent, acked = asyncio.run(go())
    assert tokens == [100 + i for i in range(n)]
    assert sent >= mux_mod.WINDOW and sent - mux_mod.WINDOW < acked <= sent


def test_a_lagging_token_stream_is_closed_and_its_hops_go_on_on_their_own_calls(muxed, monkeypatch):
    """An ingress replica too loaded to read a stream at its tokens' pace: it asks the pool to
    close the stream, reads what is left, and its hops finish on their own calls, every token
    once; no new subscription to that replica for COOLDOWN_S."""
    monkeypatch.setattr(mux_mod, "MAX_LAG_S", -1.0)  # every batch counts as late
    driver, router, pools = make()

    async def go():
        out = await asyncio.gather(*(collect(driver, request(30, route="cpu", rid=f"r{i}")) for i in range(4)))
        await asyncio.sleep(0.01)
        return out

    out = asyncio.run(go())
    for tokens, errors, trace in out:
        assert tokens == [100 + i for i in range(30)] and not errors
        assert not any(s.get("failed") for s in trace["segments"])
    assert driver.mux.lagging >= 1 and not pools["cpu_decode/0"].channels
    assert driver.mux._refused[("cpu_decode/0", "CpuDecode-r0")] > time.monotonic() + 10
    assert settled(router)


def test_a_hops_token_stream_is_open_until_it_ends_and_a_later_one_is_another():
    """`MuxClient.is_open`: true while the subscription a hop's runs came on runs, false once it
    ended, and still false when the ingress subscribes to that replica again (a new stream)."""
    async def go():
        ends = {"now": asyncio.Event()}

        async def subscribe(hop, sub):
            yield pickle.dumps((time.time(), 1, []))
            await ends["now"].wait()

        client = MuxClient("i", subscribe)
        client.want("gpu_decode", "r")
        await asyncio.sleep(0.01)
        is_open = client.is_open(("gpu_decode", "r"))
        assert is_open()
        ends["now"].set()
        await asyncio.sleep(0.01)
        assert not is_open()
        ends["now"] = asyncio.Event()
        client._refused.clear()
        client.want("gpu_decode", "r")
        await asyncio.sleep(0.01)
        assert ("gpu_decode", "r") in client._subs and not is_open()
        assert client.is_open(("gpu_decode", "r"))()
        client.close()

    asyncio.run(go())


@pytest.mark.parametrize("together", [False, True])
def test_a_hop_knows_its_token_stream_whether_its_acceptance_comes_alone_or_with_its_start(together):
    """A hand-off's hop yields HopAccepted, then SegmentStart, in runs of their own (its KV read in
    between); a new request's hop yields both in one run: either way the hop learns which
    subscription carries its tokens (the replica of its SegmentStart), and whether it is open."""
    from keyacc_ray.serve.messages import HopAccepted
    from keyacc_ray.serve.mux import MuxEnd, MuxRun

    async def go():
        async def subscribe(hop, sub):
            yield pickle.dumps((time.time(), 1, []))
            await asyncio.sleep(10)

        client = MuxClient("i", subscribe)
        client.want("gpu_decode", "r0")
        await asyncio.sleep(0.01)

        async def call():
            start = SegmentStart("gpu", "whole", "r0", "GpuDecode")
            if together:
                yield [MuxRun(0, [HopAccepted(), start])]
                yield [MuxEnd(1)]
                return
            yield [MuxRun(0, [HopAccepted()])]
            yield [MuxRun(1, [start])]
            yield [MuxEnd(2)]

        hop = client.open("gpu_decode").attach(call())
        got = [x async for items in hop for x in items]
        assert [type(x) for x in got] == [HopAccepted, SegmentStart]
        assert hop.inbox.source == ("gpu_decode", "r0") and hop.inbox.source_open()
        hop.close()
        client.close()

    asyncio.run(go())


def test_a_hops_timings_say_how_long_its_token_stream_held_batches_back_for_acks(monkeypatch):
    """mux_hop fills in HopTimings.mux_wait_ms: what the channel waited for acks while the hop
    ran (not before it); the channel counts its waits (Channel.waited_s)."""
    from keyacc_ray.serve.messages import HopTimings

    monkeypatch.setattr(mux_mod, "ACK_WAIT_S", 30.0)

    async def go():
        ch = Channel(0.0)
        ch.waited_s = 2.0  # held back before this hop began: not this hop's

        async def hop():
            yield [SegmentStart("cpu", "decode", "r", "D")]
            yield [_tok(1)]
            ch.waited_s += 0.25  # (as _wait_ack adds)
            yield [_tok(2), HopTimings(5.0, 1, 2.0)]

        out = [i for items in [x async for x in mux_hop(hop(), HopSender(ch, 1))] for i in items]
        (t,) = [i for run in out if hasattr(run, "items") for i in run.items if isinstance(i, HopTimings)]
        assert t.mux_wait_ms == 250.0

        waiting = Channel(0.0)  # and the channel's own count: a window unread, then an ack 50 ms later
        got = []

        async def reader():
            async for batch in waiting.batches():
                got.append(batch)

        task = asyncio.ensure_future(reader())
        for i in range(mux_mod.WINDOW + 1):
            waiting.put(1, i, [_tok(i)])
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        waiting.ack(mux_mod.WINDOW)
        await asyncio.sleep(0.01)
        waiting.close()
        await asyncio.wait_for(task, 2)
        assert len(got) == mux_mod.WINDOW + 1 and 0.04 <= waiting.waited_s < 0.5

    asyncio.run(go())


def test_the_trace_says_how_the_token_that_ended_a_gap_came(muxed):
    """Trace.token_gap with the hop's inbox: a token that came on the token stream has its batch's
    way from the pool's send to the ingress's reader and from there to the driver; one that came on
    the hop's own call (the first hop on a replica is not multiplexed) says so (None)."""
    driver, router, pools = make()

    async def go():
        await collect_cold(driver, request(6, route="cpu", rid="a"))  # (subscribes for the next)
        for _ in range(3):
            await asyncio.sleep(0)
        return await collect(driver, request(6, route="cpu", rid="b"))

    tokens, errors, trace = asyncio.run(go())
    (seg,) = trace["segments"]
    assert "ingress_gap_ms" in seg and driver.mux.batches > 0
    assert 0 <= seg["gap_transport_ms"] < 1000 and 0 <= seg["gap_local_ms"] < 1000

    inbox = Inbox()
    assert inbox.came() is None  # nothing on the token stream yet: the hop's own call
    inbox.came_at = (time.time() - 0.3, time.time() - 0.1)
    way, here = inbox.came()
    assert 0.19 < way < 0.21 and 0.09 < here < 0.5

    from keyacc_ray.serve.messages import SegmentStart as Start, Trace
    tr = Trace()
    tr.start(Start("gpu", "decode", "g", "GpuDecode"))
    tr.token_gap(0.5, 1.0, Inbox())  # the worst gap's token came on the hop's own call
    assert tr.segments[0]["gap_transport_ms"] is None and tr.segments[0]["gap_local_ms"] is None
    tr.token_gap(0.1, 2.0, inbox)  # not the worst: nothing changes
    assert tr.segments[0]["gap_transport_ms"] is None
    tr.token_gap(0.9, 3.0, inbox)
    assert 190 < tr.segments[0]["gap_transport_ms"] < 210
