"""One multiplexed token stream per (pool replica, ingress replica) pair.

Without it every hop of every request is its own Serve streaming call, and every chunk of
tokens crosses it as its own gRPC message: at 64 streams that per-chunk machinery (the pool's
streaming generator, the ingress's stream read and unpickling) is most of the serving stack's
CPU per token (docs/benchmarks.md, "The serving stack alone"). With it, the hop's own call stays
the control plane (Serve's routing, back-pressure, cancellation when the client goes away, a
replica's death, the hand-off, the router's period answers) and its tokens travel on a stream
the ingress replica keeps open to that pool replica (`subscribe`), which carries one message
per engine step and ingress replica with every request's new tokens.

Order across the two streams: the pool numbers the runs of items of a hop (a run: consecutive
token chunks, or consecutive other items) and sends each run on the stream it belongs to; the
hop's call ends with `MuxEnd(total)`. The ingress puts each hop's runs back in order (`Inbox`)
and hands the driver the same lists of items an unmultiplexed hop yields. A hop that starts
when no subscription from its ingress replica is open at the pool (the first requests, or
after an idle pool closed it) is not multiplexed: its call carries everything, as before, and
the ingress subscribes to that replica for the next hops. If the subscription closes in the
middle of a hop, the pool sends that hop's remaining tokens on the hop's own call (numbered the
same way, so nothing changes for the driver).

Plain Python and asyncio: the pool (`serve/pools.py`) and the ingress (`serve/driver.py`) pass
in their Serve calls.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import pickle
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from keyacc_ray.serve.aio import wait_at_most
from keyacc_ray.serve.messages import (REPLICA_GONE_ERRORS, HopTimings, ReplicaGoneError, SegmentStart, TokenChunk,
                                       merge_chunks)

log = logging.getLogger("ray.serve")
IDLE_CLOSE_S = 5.0  # a pool closes a subscription that carried no hop for this long
# Flow control: at most WINDOW batches on their way to an ingress replica that has not said it read
# them (`MuxAck`, every WINDOW // 2); meanwhile the pool's tokens gather into the next batch. An
# overloaded ingress reads a stream's messages slowly (one per few turns of its event loop) while a
# transport buffer hides it from the pool: without this, a stream fell 35 s behind in the soak. (64
# was tried, for acks that wait for a place at a full replica: at 2x with GPU kills an ingress short of
# CPU then fell 3-4 s behind its streams, 18 gaps over 2 s in one run; the window clocks the pool to
# the reader.)
WINDOW = 16
# No ack for this long (lost, or queued behind hops for a place at a full replica): send the next batch
# anyway (everything gathered meanwhile). At 1 s, streams stalled ~1 s a batch in the 2x kill soak while
# acks waited; a slow reader still gets at most one batch per ACK_WAIT_S past the window.
ACK_WAIT_S = 0.25
# A stream whose batches still arrive this late, window and all (an ingress replica too loaded to read
# it at the pace of its tokens): the ingress asks the pool to close it, reads what is left, and sends
# its hops there on calls of their own (each coalesced by its own reader's pace) for COOLDOWN_S. A
# last resort: a whole ingress short of CPU reads its own calls no faster, and pays more per token on
# them (one message per hop, not per step): at 1 s, the 2x soak's CPU kills closed the streams as the
# restarted replica took its queue, and the GPU pool's streams then stalled 2-2.6 s on their own calls
# (7 gaps over 2 s in one run; 0 in the next run with it off).
MAX_LAG_S = 10.0
COOLDOWN_S = 30.0
# A hop whose call ended waits this long for its last runs, then fails; while the token stream that
# carries them is still open, up to LATE_LIMIT_S: they are late (an ingress replica too loaded to read
# its streams at their pace fell more than 10 s behind in the kill soak), not lost: a hop failed then
# was computed again elsewhere, its stream stalled for a minute. Once that stream has ended (a broken
# one fails its hops at once) or where it is not known, LOST_AFTER_S after the call's end as before.
LOST_AFTER_S = 10.0
LATE_LIMIT_S = 120.0
RESUBSCRIBE_AFTER_S = 2.0  # an ingress waits this long before subscribing again to a replica that refused
# A hop that ended whole (its MuxEnd and every run read) before its call's own end arrived: the
# call is left to end by itself for up to this long. Cancelling it there cost a cancellation RPC and
# the replica's cancellation path for nothing (21 of 64 requests against the default app).
CALL_END_WAIT_S = 5.0


@dataclass
class Subscribe:
    """The ingress replica `ingress` asks pool replica `replica` for its tokens (the call is
    routed to that replica by the pools' request router, `serve/request_router.py`)."""
    ingress: str
    replica: str


@dataclass
class MuxRun:
    """On a multiplexed hop's own call: a run of its items other than tokens (or tokens, when
    the subscription closed), `seq` its place among the hop's runs."""
    seq: int
    items: list


@dataclass
class MuxEnd:
    """The last item of a multiplexed hop's own call: the hop had `total` runs."""
    total: int


@dataclass
class MuxAck(Subscribe):
    """The ingress replica has read `batches` batches of its subscription to `replica` (routed
    to that replica as a subscription is); `close`: end the stream (after what it holds)."""
    batches: int = 0
    close: bool = False


def is_subscribe(args) -> Subscribe | None:
    return args[0] if args and isinstance(args[0], Subscribe) else None


# ---- pool side -------------------------------------------------------------------------

class Channel:
    """A pool replica's end of one ingress replica's subscription: hops put their token runs,
    the subscription's call takes them in batches."""

    def __init__(self, interval_s: float = 0.005, idle_close_s: float | None = None):
        self.interval_s = interval_s
        self.idle_close_s = IDLE_CLOSE_S if idle_close_s is None else idle_close_s
        self.closed = False
        self.active = 0  # hops under way on it
        self._buf: list = []  # (key, seq, [TokenChunk, ...])
        self._ready = asyncio.Event()
        self.sent = 0  # batches yielded
        self.acked = 0  # batches the ingress replica said it read
        self._acked = asyncio.Event()
        self.waited_s = 0.0  # time batches were held back for acks, in all (HopTimings.mux_wait_ms)

    def ack(self, batches: int) -> None:
        if batches > self.acked:
            self.acked = batches
            self._acked.set()

    def put(self, key, seq: int, chunks: list) -> None:
        self._buf.append((key, seq, chunks))
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()
        self._acked.set()

    async def batches(self) -> AsyncIterator[list]:
        """Everything put since the last batch, at most one batch per `interval_s`; ends when
        closed (what was put before is still sent), or after `idle_close_s` with no hop on it."""
        loop = asyncio.get_running_loop()
        last = 0.0
        idle_since = time.monotonic()
        while True:
            if not self._buf and not self.closed:
                timer = loop.call_later(self.idle_close_s, self._ready.set)  # wake to look at idleness
                try:
                    await self._ready.wait()
                finally:
                    timer.cancel()
            self._ready.clear()
            now = time.monotonic()
            if self._buf:
                wait = self.interval_s - (now - last)
                if wait > 0 and not self.closed:
                    await asyncio.sleep(wait)
                if self.sent - self.acked >= WINDOW and not self.closed:
                    await self._wait_ack(loop)
                last = time.monotonic()
                batch, self._buf = self._buf, []
                self.sent += 1
                yield batch
                idle_since = time.monotonic()
            elif self.closed:
                return
            elif self.active:
                idle_since = now
            elif now - idle_since >= self.idle_close_s:
                return


    async def _wait_ack(self, loop) -> None:
        """Until the ingress replica has read enough (or ACK_WAIT_S passed, or it closed)."""
        began = time.monotonic()
        deadline = began + ACK_WAIT_S
        try:
            while self.sent - self.acked >= WINDOW and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._acked.clear()
                timer = loop.call_later(left, self._acked.set)
                try:
                    await self._acked.wait()
                finally:
                    timer.cancel()
        finally:
            self.waited_s += time.monotonic() - began


class HopSender:
    """A pool hop's end of the numbering: its token chunks go to the channel (`token`, called
    straight from the engine loop's hand-over, or from `mux_hop`), every other run on the hop's
    own call; while the channel is open."""

    def __init__(self, channel: Channel, key):
        self.channel, self.key = channel, key
        self.seq = 0

    def send(self, run: list) -> bool:
        """A run of token chunks on the channel; False (nothing sent) once it has closed."""
        if self.channel.closed:
            return False
        self.channel.put(self.key, self.seq, run)
        self.seq += 1
        return True

    def token(self, chunk: TokenChunk) -> bool:
        return self.send([chunk])

    def wrap(self, run: list) -> MuxRun:
        self.seq += 1
        return MuxRun(self.seq - 1, run)


async def mux_hop(items: AsyncIterator[list], sender: HopSender | None) -> AsyncIterator[list]:
    """A pool hop's item lists as its own call yields them: unchanged without a sender; with
    one, each run of token chunks goes to the channel (while it is open) and everything else
    comes out here as `MuxRun`s, then `MuxEnd`. The hop's HopTimings say how long the channel held
    batches back for acks while the hop ran."""
    if sender is None:
        async for batch in items:
            yield batch
        return
    channel = sender.channel
    channel.active += 1
    waited = channel.waited_s
    try:
        async for batch in items:
            out = []
            for is_tokens, run in _runs(batch):
                if not (is_tokens and sender.send(run)):
                    for it in run:
                        if type(it) is HopTimings:
                            it.mux_wait_ms = round((channel.waited_s - waited) * 1e3, 2)
                    out.append(sender.wrap(run))
            if out:
                yield out
        yield [MuxEnd(sender.seq)]
    finally:
        channel.active -= 1


def hop_sender(channels: dict, mux: tuple | None) -> HopSender | None:
    """The sender of a hop whose call came with `mux` (ingress replica, key), if that ingress
    replica's token stream from here is open."""
    channel = channels.get(mux[0]) if mux else None
    return HopSender(channel, mux[1]) if channel is not None and not channel.closed else None


async def subscription(channels: dict, sub: Subscribe, replica: str, interval_s: float) -> AsyncIterator[list]:
    """A pool replica's side of `subscribe`: batches of (key, seq, token chunks) of the hops of
    ingress replica `sub.ingress`, through a channel kept in `channels` while it is open. A call
    that reached another replica than the one it names ends at once (the ingress asks later)."""
    if sub.replica != replica:
        return
    channel = Channel(interval_s)
    old = channels.get(sub.ingress)
    if old is not None:
        old.close()
    channels[sub.ingress] = channel
    try:
        async for batch in channel.batches():
            # pickled here, by the C pickler: Serve's cloudpickle visits every object in Python
            yield pickle.dumps((time.time(), channel.sent, batch), protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        channel.close()
        if channels.get(sub.ingress) is channel:
            del channels[sub.ingress]


def take_ack(channels: dict, ack: MuxAck, replica: str) -> None:
    """A pool replica's side of `mux_ack`."""
    channel = channels.get(ack.ingress)
    if channel is not None and ack.replica == replica:
        channel.ack(ack.batches)
        if ack.close:
            channel.close()


def _runs(batch: list):
    for is_tokens, run in itertools.groupby(batch, lambda it: type(it) is TokenChunk):
        yield is_tokens, list(run)


# ---- ingress side ----------------------------------------------------------------------

class Inbox:
    """One hop's items, from its own call and the subscription, back in order."""

    def __init__(self):
        self._next = 0
        self._early: dict[int, list] = {}
        self._ready: list = []
        self._total: int | None = None
        self._ended = False  # the call ended (unmultiplexed: that is the hop's end)
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._ended_at: float | None = None  # when get() first found the call ended and runs missing
        self.muxed = False
        self.source: tuple[str, str] | None = None  # (hop, replica) whose subscription carries it
        self.source_open: Callable[[], bool] | None = None  # that subscription is still open
        # the last token run that came on the subscription: when the pool sent its batch, when this
        # replica's reader took it (wall clock, time.time()); None after tokens on the hop's own call
        self.came_at: tuple[float, float] | None = None

    def came(self) -> tuple[float, float] | None:
        """For the tokens read last: (their batch's way from the pool's send to the reader, and
        from the reader to now), seconds; None if they came on the hop's own call."""
        if self.came_at is None:
            return None
        sent, read = self.came_at
        return read - sent, time.time() - read

    def run(self, seq: int, items: list) -> None:
        if seq < self._next:
            return
        self._early[seq] = items
        while self._next in self._early:
            self._ready.extend(self._early.pop(self._next))
            self._next += 1
        self._wake.set()

    def plain(self, items: list) -> None:
        self._ready.extend(items)
        self._wake.set()

    def end(self, total: int | None = None) -> None:
        if total is not None:
            self._total = total
        else:
            self._ended = True
        self._wake.set()

    def fail(self, e: BaseException) -> None:
        self._error = e
        self._wake.set()

    def _done(self) -> bool:
        if self.muxed:
            return self._total is not None and self._next >= self._total
        return self._ended

    def whole(self) -> bool:
        """Everything of the hop came and was read, with no error."""
        return self._done() and self._error is None and not self._ready

    async def get(self) -> list | None:
        """The next items in order (consecutive token chunks merged); None at the hop's end.
        Raises what broke the hop's call, after the items that came before it."""
        while True:
            if self._ready:
                out, self._ready = self._ready, []
                return merge_chunks(out) if len(out) > 1 else out
            if self._error is not None:
                raise self._error
            if self._done():
                return None
            if self._ended and self.muxed and self._total is None:  # the call ended without its MuxEnd
                raise ConnectionError("the pool's stream ended early")
            self._wake.clear()
            if self._total is None:
                await self._wake.wait()
                continue
            # the call has ended: what is missing is on its way, or lost with the subscription
            if self._ended_at is None:
                self._ended_at = time.monotonic()
            waited = time.monotonic() - self._ended_at
            open_ = self.source_open is not None and self.source_open()
            left = (LATE_LIMIT_S if open_ else LOST_AFTER_S) - waited
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                await wait_at_most(self._wake.wait(), min(left, LOST_AFTER_S))
            except asyncio.TimeoutError:
                if open_ and waited < LATE_LIMIT_S:
                    continue  # late on a stream still open: wait on (its end wakes this wait)
                raise ConnectionError(f"tokens of the hop lost (runs {self._next}..{self._total - 1})") from None


class MuxHop:
    """The driver's view of one hop: iterate it for the hop's item lists; `close()` always."""

    def __init__(self, client: "MuxClient", hop: str):
        self.client, self.hop = client, hop
        self.key = next(client._keys)
        self.inbox = Inbox()
        client._inboxes[self.key] = self.inbox
        self._reader: asyncio.Task | None = None

    @property
    def call_kwargs(self) -> dict:
        return {"mux": (self.client.ingress, self.key)}

    def attach(self, stream) -> "MuxHop":
        self._reader = asyncio.ensure_future(self._read(stream))
        return self

    async def _read(self, stream) -> None:
        inbox = self.inbox
        try:
            async for items in stream:
                for it in items:
                    if type(it) is MuxRun:
                        inbox.muxed = True
                        if it.items and type(it.items[0]) is TokenChunk:  # (the subscription closed)
                            inbox.came_at = None
                        if inbox.source is None:  # (its HopAccepted may come in a run of its own first)
                            start = next((x for x in it.items if type(x) is SegmentStart), None)
                            if start is not None:
                                inbox.source = (self.hop, start.replica)
                                inbox.source_open = self.client.is_open(inbox.source)
                        inbox.run(it.seq, it.items)
                    elif type(it) is MuxEnd:
                        inbox.muxed = True
                        inbox.end(it.total)
                    else:
                        if type(it) is SegmentStart and not inbox.muxed:
                            self.client.want(self.hop, it.replica)
                        inbox.plain([it])
            inbox.end()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the driver sees it as the hop's own error
            inbox.fail(e)

    def __aiter__(self):
        return self

    async def __anext__(self) -> list:
        items = await self.inbox.get()
        if items is None:
            raise StopAsyncIteration
        return items

    def close(self) -> None:
        self.client._inboxes.pop(self.key, None)
        reader = self._reader
        if reader is None or reader.done():
            return
        if self.inbox.whole():  # only the call's end is still on its way
            asyncio.get_running_loop().call_later(CALL_END_WAIT_S, reader.cancel)
        else:  # the client went away, or the hop broke: its replica stops it
            reader.cancel()


class MuxClient:
    """An ingress replica's subscriptions, one per pool replica it has sent hops to.
    `subscribe(hop, Subscribe)` makes the streaming call (routed to that replica)."""

    def __init__(self, ingress: str, subscribe: Callable[[str, Subscribe], AsyncIterator[list]],
                 ack: Callable[[str, MuxAck], Awaitable] | None = None):
        self.ingress = ingress
        self.subscribe = subscribe
        self.ack = ack  # sends a MuxAck to the replica (without it the pool waits ACK_WAIT_S per window)
        self._acks: set[asyncio.Task] = set()
        self._acking: set[tuple[str, str]] = set()
        self._keys = itertools.count()
        self._inboxes: dict[int, Inbox] = {}
        self._subs: dict[tuple[str, str], asyncio.Task] = {}
        self._refused: dict[tuple[str, str], float] = {}
        self.batches = 0  # subscription messages received (for tests and benchmarks)
        self.lagging = 0  # subscriptions closed for lag
        self.subscriptions = 0

    def open(self, hop: str) -> MuxHop:
        return MuxHop(self, hop)

    def is_open(self, k: tuple[str, str]) -> Callable[[], bool]:
        """Whether the subscription to (hop, replica) open now is still open later (not one
        opened after it ended)."""
        task = self._subs.get(k)
        return lambda: task is not None and not task.done() and self._subs.get(k) is task

    def want(self, hop: str, replica: str) -> None:
        """A hop ran unmultiplexed on this replica: subscribe to it (once, in the background)."""
        k = (hop, replica)
        if k in self._subs or time.monotonic() < self._refused.get(k, 0.0):
            return
        self._subs[k] = asyncio.ensure_future(self._subscription(k))

    async def _subscription(self, k: tuple[str, str]) -> None:
        got = broken = closing = gone = False
        acked = 0
        self.subscriptions += 1
        stream = None
        try:
            stream = self.subscribe(k[0], Subscribe(self.ingress, k[1]))
            async for data in stream:
                got = True
                self.batches += 1
                inboxes = self._inboxes
                sent, n, batch = pickle.loads(data)  # from our own pool replica (subscription())
                read = time.time()
                lag = read - sent
                if lag > MAX_LAG_S and not closing and self.ack is not None:
                    closing = True
                    self.lagging += 1
                    self._refused[k] = time.monotonic() + COOLDOWN_S
                    log.warning("token stream from %s %s: a batch %.2f s late; closing it, hops there on "
                                "calls of their own for %.0f s", k[0], k[1], lag, COOLDOWN_S)
                    self._send_ack(k, n, close=True)
                came = (sent, read)
                for key, seq, chunks in batch:
                    inbox = inboxes.get(key)
                    if inbox is not None:
                        inbox.came_at = came
                        inbox.run(seq, chunks)
                if n - acked >= WINDOW // 2 and self.ack is not None and k not in self._acking and not closing:
                    acked = n
                    self._send_ack(k, n)
        except asyncio.CancelledError:
            broken = True
            if stream is not None and hasattr(stream, "cancel"):
                stream.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - replica gone or full: its hops say so on their own calls
            log.info("token stream from %s %s ended (%s)", k[0], k[1], e.__class__.__name__)
            got, broken = False, True
            gone = e.__class__.__name__ in REPLICA_GONE_ERRORS
        finally:
            self._subs.pop(k, None)
            # Broken (not closed by the pool, which sends what it holds first and the rest of its
            # hops on their own calls): the hops under way on it lost what was in flight. They
            # fail, and go on elsewhere from the tokens the client has, as when a replica dies.
            # Closed: its hops still missing runs after their calls ended learn it now (`Inbox.get`).
            for inbox in list(self._inboxes.values()):
                if inbox.source == k and not inbox._done():
                    if broken:  # (with its replica's death, the hop's failure is that news too)
                        inbox.fail((ReplicaGoneError if gone else ConnectionError)(
                            f"token stream from {k[0]} {k[1]} broke"))
                    else:
                        inbox._wake.set()
        if not got:  # refused (another replica took the call), full or gone: not again at once
            self._refused[k] = max(self._refused.get(k, 0.0), time.monotonic() + RESUBSCRIBE_AFTER_S)
            if len(self._refused) > 1024:
                now = time.monotonic()
                self._refused = {r: t for r, t in self._refused.items() if t > now}

    def _send_ack(self, k: tuple[str, str], n: int, close: bool = False) -> None:
        """One ack in flight per subscription (the next batch past the half window sends the next)."""
        async def send():
            self._acking.add(k)
            try:
                await self.ack(k[0], MuxAck(self.ingress, k[1], n, close))
            except Exception as e:  # noqa: BLE001 - the pool sends on after ACK_WAIT_S
                log.debug("ack to %s %s failed (%s)", k[0], k[1], e.__class__.__name__)
            finally:
                self._acking.discard(k)

        task = asyncio.ensure_future(send())
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    def close(self) -> None:
        for task in list(self._subs.values()):
            task.cancel()
