"""Drive an LLMEngine from a background thread and stream its outputs to asyncio callers.

The thread owns the engine: it takes commands from an inbox between steps (add, import, abort,
export, withdraw), runs `engine.step()` while there is work (torch releases the GIL, so the
replica's event loop stays responsive), and hands each step's outputs to the waiting streams. A
caller reads a batch of everything produced since its last read, so a slow reader gets bigger
chunks instead of one round trip per token. A sequence with `export_after=N` is exported right
after its Nth token on this engine and its stream ends with the hand-off. A sequence with
`check_every=N` keeps decoding and gets a `Checkpoint` in its stream after every N tokens here;
`export(request_id)` then hands it off at the next step boundary (an elastic-pipeline period
whose check says "stay" costs nothing). `withdraw(request_id)` takes a sequence still waiting to
run out of the engine (its stream ends with `Withdrawn`). No Ray here: the pool injects
`on_export` to place the package in the object store.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from keyacc_ray.engine.kv_package import KVPackage
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.errors import KeyaccError, is_failure
from keyacc_ray.hw.pinning import ENGINE_THREAD_NAME, name_os_thread
from keyacc_ray.serve.messages import ErrorItem, HopTimings, TokenChunk, Withdrawn, merge_chunks
from keyacc_ray.serve.step_profile import StepProfiler

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """In a `check_every` stream: this many tokens were produced here; the sequence keeps going."""
    produced: int
    num_output_tokens: int


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    export_after: int | None
    check_every: int | None = None
    produced: int = 0
    movable: bool = False  # preempted (lazy KV), the sequence leaves with its KV instead of waiting here
    export_skip: int = 0  # its export after `export_after` tokens, or when preempted, leaves this head's K/V out
    # takes each TokenChunk on the event loop, straight from the engine thread's hand-over (a
    # multiplexed token stream, serve/mux.py); False: it did not, the chunk goes to the queue
    sink: Callable[[TokenChunk], bool] | None = None
    # where its tokens waited (HopTimings): the engine thread's step ends that made them, the
    # event loop's wait for each hand-over
    made_at: float = 0.0
    made_gap: float = 0.0
    made_gap_after: int = 0
    loop_lag: float = 0.0

    def timings(self) -> HopTimings:
        return HopTimings(round(self.made_gap * 1e3, 2), self.made_gap_after, round(self.loop_lag * 1e3, 2))


def _internal_error(message: str) -> ErrorItem:
    return ErrorItem(500, {"error": {"message": message, "type": "internal_error", "param": None, "code": None}})


def _put_all(items: list, handed_at: float) -> None:
    lag = time.monotonic() - handed_at  # the engine thread handed these over this long ago
    for stream, item in items:
        if lag > stream.loop_lag:
            stream.loop_lag = lag
        if stream.sink is None or type(item) is not TokenChunk or not stream.sink(item):
            stream.q.put_nowait(item)


_END = object()
TPS_BUCKET_S = 0.01  # tokens_per_s's resolution
TPS_KEEP_S = 5.0  # and the longest window it can answer for
# A step this slow is logged (at most once per SLOW_STEP_LOG_EVERY_S) with what it held and how much
# of its time the engine thread had a core for (thread CPU time over wall time): a stream stalls
# for as long, and the two causes want different mends (a step too big, or a starved process).
SLOW_STEP_S = 1.0
SLOW_STEP_LOG_EVERY_S = 10.0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_export: Callable[[KVPackage], object],
                 stream_interval_s: float = 0.005):
        self.engine = engine
        self.stream_interval_s = stream_interval_s
        self.on_export = on_export
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._out: list[tuple[_Stream, object]] = []  # this iteration's items, delivered together
        self._stop = False
        self._profiler = StepProfiler.from_env(label=str(getattr(getattr(engine, "runner", None), "device", "")))
        self.error: BaseException | None = None
        self.slow_steps = 0  # steps over SLOW_STEP_S
        self._slow_logged = -SLOW_STEP_LOG_EVERY_S
        # (when, tokens) of the last TPS_KEEP_S, oldest first: an entry per TPS_BUCKET_S (the engine
        # thread appends and trims; a rebuilt list of every step's entry was a sixth of a busy
        # replica's CPU at 200 steps a second)
        self._tps_window: collections.deque = collections.deque()
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()

    # ---- caller side (event loop) ------------------------------------------------------
    async def generate(self, request_id: str, *, prompt_ids: list[int] | None = None,
                       params: SamplingParams, package: KVPackage | None = None,
                       export_after: int | None = None, check_every: int | None = None,
                       movable: bool = False, sink: Callable[[TokenChunk], bool] | None = None,
                       export_skip: int = 0, timings: bool = False) -> AsyncIterator[list]:
        """Yields lists of TokenChunk / ErrorItem / Checkpoint / hand-off objects until the sequence
        ends. `movable`: if the engine preempts it, it is handed off (KV and all) instead.
        `sink`: takes the token chunks instead (those it refuses come here as before).
        `export_skip`: the hand-off after `export_after` tokens, or a movable one's when preempted,
        leaves this head's K/V out. `timings`: the stream ends with its HopTimings."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), export_after, check_every, movable=movable,
                         sink=sink, export_skip=export_skip)
        self._inbox.put(("add", request_id, prompt_ids, params, package, stream))
        self._wake.set()
        done = False
        last = 0.0
        try:
            while not done:
                items = [await stream.q.get()]
                # Coalesce: at most one chunk per stream interval, so each Serve hop costs per
                # chunk, not per token, when the engine outpaces the hops.
                wait = self.stream_interval_s - (time.monotonic() - last)
                if wait > 0 and items[0] is not _END:
                    await asyncio.sleep(wait)
                last = time.monotonic()
                while not stream.q.empty():
                    items.append(stream.q.get_nowait())
                if _END in items:
                    done = True
                    items = [i for i in items if i is not _END]
                    if timings:
                        items.append(stream.timings())
                if items:
                    yield merge_chunks(items)
        finally:
            if not done:  # the client went away: free the sequence and its blocks now
                self._inbox.put(("abort", request_id))
                self._wake.set()

    def note(self, request_id: str, item) -> bool:
        """Put `item` into a sequence's stream now, from the event loop (its tokens may not pass
        through it: `sink`); False if the stream has ended."""
        s = self._streams.get(request_id)
        if s is None or s.loop is not asyncio.get_running_loop():
            return False
        s.q.put_nowait(item)
        return True

    def export(self, request_id: str, skip_tokens: int = 0) -> None:
        """Hand a running sequence off at the next step boundary (its stream ends with the hand-off);
        nothing if it has finished by then. `skip_tokens`: the head its next engine is expected to
        cache (LLMEngine.export_request)."""
        self._inbox.put(("export", request_id, skip_tokens))
        self._wake.set()

    def stop_checks(self, request_id: str) -> None:
        """No more `Checkpoint`s in this sequence's stream (it stays here to the end)."""
        s = self._streams.get(request_id)
        if s is not None:
            s.check_every = None

    def withdraw(self, request_id: str) -> None:
        """If the sequence is still waiting, never run, it leaves and its stream ends with
        `Withdrawn`; once it has run, nothing happens (its tokens keep coming)."""
        self._inbox.put(("withdraw", request_id))
        self._wake.set()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def tokens_per_s(self, window_s: float = 2.0) -> float:
        now = time.monotonic()
        return sum(n for t, n in list(self._tps_window) if now - t <= window_s) / window_s

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread(ENGINE_THREAD_NAME)  # its CPU told from the replica's other threads' (cpu_account)
        while not self._stop:
            self._wake.clear()  # before draining: a command put after this sets it again
            self._drain_inbox()
            self._deliver()
            if not self.engine.has_unfinished():
                self._wake.wait(1.0)  # every command and shutdown set it: no need to poll
                continue
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                outputs = self._profiler.step(self.engine.step) if self._profiler else self.engine.step()
            except BaseException as e:  # noqa: BLE001 - a bug must not hang every stream
                if not is_failure(e):  # (a native library's panic is a bug too)
                    raise
                log.exception("engine step failed")
                self.error = e
                self._fail_all(f"engine step failed: {e}")
                self._deliver()
                continue
            now = time.monotonic()
            if now - t0 > SLOW_STEP_S:
                self._slow_step(now - t0, time.thread_time() - c0, len(outputs))
            window = self._tps_window
            if window and now - window[-1][0] < TPS_BUCKET_S:
                window[-1][1] += len(outputs)
            else:
                window.append([now, len(outputs)])
            while now - window[0][0] > TPS_KEEP_S:
                window.popleft()
            for o in outputs:
                s = self._streams.get(o.request_id)
                if s is None:
                    continue
                if s.produced and now - s.made_at > s.made_gap:
                    s.made_gap, s.made_gap_after = now - s.made_at, s.produced
                s.made_at = now
                s.produced += len(o.new_token_ids)
                self._push(s, TokenChunk(o.new_token_ids, o.text, o.finish_reason, o.num_prompt_tokens,
                                         o.num_output_tokens, o.logprobs, o.prompt_logprobs, o.num_cached_tokens))
                if o.finished:
                    self._close(o.request_id)
                elif s.export_after is not None and s.produced >= s.export_after:
                    self._export(o.request_id, s, skip_tokens=s.export_skip)
                elif s.check_every and s.produced % s.check_every == 0:
                    self._push(s, Checkpoint(s.produced, o.num_output_tokens))
            self._hand_off_preempted()
            self._deliver()

    def _slow_step(self, wall: float, cpu: float, tokens: int) -> None:
        self.slow_steps += 1
        now = time.monotonic()
        if now - self._slow_logged < SLOW_STEP_LOG_EVERY_S:
            return
        self._slow_logged = now
        sch = getattr(self.engine, "scheduler", None)  # (a stand-in engine, bench/token_source.py, has none)
        held = "" if sch is None else (f", {sch.num_running} running, {sch.num_waiting} waiting, "
                                       f"{sch.num_preemptions} preemptions so far")
        log.warning("engine step took %.2f s (its thread on a core %.0f%% of it): %d tokens out%s; %d steps over "
                    "%g s since start", wall, 100 * cpu / wall, tokens, held, self.slow_steps, SLOW_STEP_S)

    def _push(self, stream: _Stream, item) -> None:
        self._out.append((stream, item))

    def _deliver(self) -> None:
        """Everything this iteration produced, handed to the event loop in one call: one wake-up
        of the replica's loop per engine step, not one per stream (and order kept per stream)."""
        if not self._out:
            return
        batch, self._out = self._out, []
        by_loop: dict = {}
        for stream, item in batch:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items, time.monotonic())
            except RuntimeError:  # that caller's loop is closed: nobody is reading
                log.debug("dropping %d items for a closed event loop", len(items))

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "abort":
                self._streams.pop(cmd[1], None)
                self.engine.abort(cmd[1])
                continue
            if cmd[0] == "withdraw":
                s = self._streams.get(cmd[1])
                if s is not None and self.engine.withdraw(cmd[1]):
                    self._push(s, Withdrawn())
                    self._close(cmd[1])
                continue
            if cmd[0] == "export":
                s = self._streams.get(cmd[1])
                if s is not None and cmd[1] in self.engine.seqs:
                    self._export(cmd[1], s, skip_tokens=cmd[2])
                continue
            _, rid, prompt_ids, params, package, stream = cmd
            try:
                if package is not None:
                    self.engine.import_request(package, rid, params)
                else:
                    self.engine.add_request(rid, prompt_ids, params)
            except KeyaccError as e:
                self._push(stream, ErrorItem(e.status_code, e.to_dict()))
                self._push(stream, _END)
                continue
            except BaseException as e:  # noqa: BLE001
                if not is_failure(e):
                    raise
                log.exception("could not add request %s", rid)
                self._push(stream, _internal_error(f"internal error: {e}"))
                self._push(stream, _END)
                continue
            self._streams[rid] = stream
            if stream.movable:
                self.engine.move_on_preempt[rid] = stream.export_skip

    def _hand_off_preempted(self) -> None:
        """Sequences the engine preempted and exported (movable ones): their streams end with the
        hand-off, and the driver asks the router where they go on."""
        pkgs, self.engine.preempt_exports = self.engine.preempt_exports, []
        for pkg in pkgs:
            s = self._streams.get(pkg.request_id)
            if s is None:
                continue
            self._export(pkg.request_id, s, pkg)

    def _export(self, rid: str, s: _Stream, pkg: KVPackage | None = None, skip_tokens: int = 0) -> None:
        """End the stream with the sequence's hand-off (exported now unless `pkg` already is)."""
        try:
            if pkg is None:
                pkg = self.engine.export_request(rid, skip_tokens=skip_tokens)
            self._push(s, self.on_export(pkg))
        except Exception as e:  # noqa: BLE001
            log.exception("export of %s failed", rid)
            self._push(s, _internal_error(f"KV export failed: {e}"))
            self.engine.abort(rid)
        self._close(rid)

    def _close(self, rid: str) -> None:
        s = self._streams.pop(rid, None)
        if s is not None:
            self._push(s, _END)

    def _fail_all(self, msg: str) -> None:
        for rid in list(self._streams):
            self._push(self._streams[rid], _internal_error(msg))
            self.engine.abort(rid)
            self._close(rid)
