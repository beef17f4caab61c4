"""AsyncEngine (the pools' engine thread) over a fake engine: streams, abort on a cancelled
stream, and an idle thread that sleeps until a command comes instead of polling."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.serve.engine_loop import AsyncEngine
from keyacc_ray.serve.messages import TokenChunk


@dataclass
class Out:
    request_id: str
    new_token_ids: list
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class FakeEngine:
    """Each step gives every request its next token (100, 101, ...) until max_tokens."""

    def __init__(self):
        self.reqs: dict[str, list] = {}
        self.lock = threading.Lock()
        self.idle_checks = 0
        self.aborted: list[str] = []
        self.move_on_preempt: dict[str, int] = {}  # LLMEngine's lazy-KV hand-off interface (unused here)
        self.preempt_exports: list = []

    def add_request(self, rid, prompt_ids, params):
        self.reqs[rid] = [len(prompt_ids), params.max_tokens, 0]

    def abort(self, rid):
        self.aborted.append(rid)
        self.reqs.pop(rid, None)

    def has_unfinished(self):
        if not self.reqs:
            self.idle_checks += 1
        return bool(self.reqs)

    def step(self):
        time.sleep(0.002)
        outs = []
        for rid, r in list(self.reqs.items()):
            r[2] += 1
            done = r[2] >= r[1]
            outs.append(Out(rid, [99 + r[2]], "x", "length" if done else None, r[0], r[2]))
            if done:
                del self.reqs[rid]
        return outs


async def _collect(loop: AsyncEngine, rid: str, n: int) -> list[int]:
    toks = []
    async for items in loop.generate(rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=n)):
        for it in items:
            assert isinstance(it, TokenChunk)
            toks += it.token_ids
    return toks


def test_streams_every_token_of_concurrent_requests():
    eng = FakeEngine()
    loop = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.0)
    try:
        async def main():
            return await asyncio.wait_for(asyncio.gather(*(_collect(loop, f"r{i}", 5 + i) for i in range(4))), 10)
        res = asyncio.run(main())
        assert res == [list(range(100, 105 + i)) for i in range(4)]
    finally:
        loop.shutdown()


def test_one_wake_up_of_the_callers_loop_per_engine_step():
    """Each step's items for every stream reach the event loop in one call_soon_threadsafe
    (each is a self-pipe write and a loop wake-up; per stream it cost a syscall per token)."""
    eng = FakeEngine()
    steps = []
    real_step = eng.step
    eng.step = lambda: steps.append(1) or real_step()
    loop = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.0)
    try:
        async def main():
            ev = asyncio.get_running_loop()
            calls = []
            real = ev.call_soon_threadsafe
            ev.call_soon_threadsafe = lambda *a, **k: calls.append(1) or real(*a, **k)
            res = await asyncio.wait_for(asyncio.gather(*(_collect(loop, f"r{i}", 12) for i in range(8))), 10)
            return res, len(calls)
        res, calls = asyncio.run(main())
        assert res == [list(range(100, 112))] * 8
        # 8 streams x 12 tokens (+ 8 ends) were 104 wake-ups; now at most one per step, plus the
        # commands' own iterations (adds arrive while the first steps run)
        assert len(steps) >= 12
        assert calls <= len(steps) + 8, (calls, len(steps))
    finally:
        loop.shutdown()


def test_a_slow_reader_gets_its_tokens_merged_into_one_chunk_per_read():
    eng = FakeEngine()
    loop = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.03)  # steps take 2 ms
    try:
        async def main():
            batches = []
            async for items in loop.generate("slow", prompt_ids=[1, 2], params=SamplingParams(max_tokens=40)):
                batches.append(items)
            return batches
        batches = asyncio.run(asyncio.wait_for(main(), 10))
        assert all(len(b) == 1 and isinstance(b[0], TokenChunk) for b in batches)
        chunks = [b[0] for b in batches]
        assert [t for c in chunks for t in c.token_ids] == list(range(100, 140))
        assert "".join(c.text for c in chunks) == "x" * 40
        assert max(len(c.token_ids) for c in chunks) > 1 and len(chunks) < 40
        assert [c.finish_reason for c in chunks][-1] == "length" and chunks[-1].num_output_tokens == 40
        assert all(c.finish_reason is None for c in chunks[:-1])
    finally:
        loop.shutdown()


def test_merge_chunks_keeps_other_items_in_place():
    from keyacc_ray.serve.engine_loop import Checkpoint
    from keyacc_ray.serve.messages import merge_chunks

    a, b, c = TokenChunk([1], "a", None, 3, 1), TokenChunk([2], "b", None, 3, 2), TokenChunk([3], "c", "stop", 3, 3)
    cp = Checkpoint(2, 2)
    assert merge_chunks([a, b, cp, c]) == [TokenChunk([1, 2], "ab", None, 3, 2), cp, c]
    assert merge_chunks([a, c, b]) == [TokenChunk([1, 3], "ac", "stop", 3, 3), b]  # nothing joins a finished one
    assert merge_chunks([]) == []
    scored = TokenChunk([1], "a", None, 3, 1, prompt_logprobs=[None, (-1.0, []), (-2.0, [])])
    assert merge_chunks([scored, b])[0].prompt_logprobs == scored.prompt_logprobs  # the first token's, kept


def test_idle_thread_waits_for_a_command_instead_of_polling():
    eng = FakeEngine()
    loop = AsyncEngine(eng, on_export=lambda p: p)
    try:
        time.sleep(0.1)
        checks = eng.idle_checks
        time.sleep(0.6)
        assert eng.idle_checks - checks <= 1  # a 50 ms poll would have looked about 12 times
        t0 = time.monotonic()
        assert asyncio.run(asyncio.wait_for(_collect(loop, "late", 3), 10)) == [100, 101, 102]
        assert time.monotonic() - t0 < 0.9  # woken by the command, not by the 1 s timeout
    finally:
        loop.shutdown()


def test_a_cancelled_stream_aborts_its_sequence():
    eng = FakeEngine()
    loop = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.0)
    try:
        async def main():
            gen = loop.generate("gone", prompt_ids=[1], params=SamplingParams(max_tokens=10_000))
            await gen.__anext__()
            await gen.aclose()  # what a client disconnect does to the replica's stream
            for _ in range(100):
                if "gone" in eng.aborted:
                    return
                await asyncio.sleep(0.02)
        asyncio.run(main())
        assert eng.aborted == ["gone"] and not eng.reqs
    finally:
        loop.shutdown()


def test_checkpoints_keep_decoding_and_export_hands_off_mid_stream(qwen3_path):
    """`check_every`: a Checkpoint after every N tokens while the sequence goes on decoding;
    `export()` hands it off at the next step, and another engine continues it to exactly
    transformers' greedy output (the real engine, the tiny model)."""
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.serve.engine_loop import Checkpoint
    from tests.helpers import hf_greedy

    prompt, n = [5, 17, 42, 7, 99, 3], 24
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    loop = AsyncEngine(LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, dtype="float32")),
                       on_export=lambda pkg: pkg, stream_interval_s=0.0)

    async def run():
        got, checks, pkg = [], [], None
        async for items in loop.generate("a", prompt_ids=prompt, params=params, check_every=5):
            for it in items:
                if isinstance(it, Checkpoint):
                    checks.append(it.produced)
                    if it.produced == 10:
                        loop.export("a")
                elif isinstance(it, TokenChunk):
                    got.extend(it.token_ids)
                else:
                    pkg = it
        return got, checks, pkg

    try:
        got, checks, pkg = asyncio.run(run())
    finally:
        loop.shutdown()
    assert checks == [5, 10] and pkg is not None and 10 <= len(got) < n
    assert pkg.token_ids == prompt + got  # handed off right where the stream stopped
    other = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, dtype="float32"))
    other.import_request(pkg, "b")
    rest = []
    while other.has_unfinished():
        rest += [t for o in other.step() for t in o.new_token_ids]
    assert got + rest == hf_greedy(qwen3_path, prompt, n)


def test_step_profile_writes_launches_and_ops_per_step(qwen3_path, tmp_path, monkeypatch):
    """KEYACC_PROFILE_STEPS=DIR:SKIP:COUNT profiles COUNT engine steps after SKIP (the real
    engine): a table of ops by self CPU time, with per-step figures on top."""
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine

    monkeypatch.setenv("KEYACC_PROFILE_STEPS", f"{tmp_path}:3:6")
    loop = AsyncEngine(LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, dtype="float32", cpu_kernels="off")),
                       on_export=lambda p: p, stream_interval_s=0.0)
    try:
        async def main():
            return await asyncio.gather(*(_collect(loop, f"p{i}", 16) for i in range(2)))
        assert [len(t) for t in asyncio.run(asyncio.wait_for(main(), 60))] == [16, 16]
    finally:
        loop.shutdown()
    files = list(tmp_path.glob("steps-*.txt"))
    assert len(files) == 1
    text = files[0].read_text()
    assert "(cpu) pid" in text and "6 steps profiled after 3" in text and "rows (tokens) per step 2.0" in text
    assert "aten::" in text  # the model's ops, by self CPU time
    per_step = float(text.split("aten ops per step ")[1].split(",")[0])
    assert per_step > 20  # a 2-layer transformer step is dozens of ops


def test_withdraw_ends_a_waiting_stream_and_leaves_a_running_one(qwen3_path):
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.serve.messages import Withdrawn

    loop = AsyncEngine(LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=1, dtype="float32")), on_export=lambda p: p)
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

    async def read(rid, got):
        async for items in loop.generate(rid, prompt_ids=[5, 6, 7], params=long):
            got.extend(items)

    async def scenario():
        first, second = [], []
        a = asyncio.ensure_future(read("a", first))
        while not first:
            await asyncio.sleep(0.01)
        b = asyncio.ensure_future(read("b", second))
        while "b" not in loop.engine.seqs:
            await asyncio.sleep(0.001)
        loop.withdraw("b")  # waiting behind "a": it leaves
        loop.withdraw("a")  # running: nothing happens
        await asyncio.wait_for(asyncio.gather(a, b), 60)
        return first, second

    try:
        first, second = asyncio.run(scenario())
    finally:
        loop.shutdown()
    assert second == [Withdrawn()]
    assert sum(len(c.token_ids) for c in first if isinstance(c, TokenChunk)) == 300


def test_a_sink_takes_the_token_chunks_on_the_event_loop_and_the_stream_keeps_the_rest(qwen3_path):
    """A multiplexed hop (serve/mux.py): its token chunks go to `sink` straight from the engine
    thread's hand-over, its checkpoints and hand-off through the stream, and `note` puts an item
    into the stream at once. A sink that refuses (its token stream closed) sends the rest back
    through the stream. Every token exactly once, in order, on the real engine."""
    from keyacc_ray.config import EngineConfig
    from keyacc_ray.engine.llm_engine import LLMEngine
    from keyacc_ray.serve.engine_loop import Checkpoint
    from tests.helpers import hf_greedy

    prompt, n = [5, 17, 42, 7, 99, 3], 30
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    loop = AsyncEngine(LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, dtype="float32")),
                       on_export=lambda pkg: pkg, stream_interval_s=0.0)

    async def run():
        order, sunk = [], []
        ev = asyncio.get_running_loop()

        def sink(chunk):
            assert asyncio.get_running_loop() is ev  # on the event loop, not the engine thread
            if sum(len(c.token_ids) for c in sunk) >= 12:
                return False  # closed from here on
            sunk.append(chunk)
            order.append(("sink", chunk.token_ids))
            return True

        async for items in loop.generate("a", prompt_ids=prompt, params=params, check_every=5, sink=sink):
            for it in items:
                if isinstance(it, Checkpoint):
                    order.append(("check", it.produced))
                    if it.produced == 5:
                        assert loop.note("a", "noted")
                elif isinstance(it, TokenChunk):
                    order.append(("stream", it.token_ids))
                else:
                    order.append(("item", it))
        assert not loop.note("a", "late")  # ended
        return order

    try:
        order = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        loop.shutdown()
    tokens = [t for kind, v in order if kind in ("sink", "stream") for t in v]
    assert tokens == hf_greedy(qwen3_path, prompt, n)
    kinds = [k for k, _ in order]
    assert "stream" in kinds and kinds.index("stream") > max(i for i, k in enumerate(kinds) if k == "sink")
    assert ("item", "noted") in order and ("check", 5) in order


def test_a_panic_in_a_native_library_fails_the_streams_and_the_thread_goes_on():
    """A Rust panic (pyo3's PanicException, a BaseException) in a step or while adding a request
    is a bug like any other: the streams it hits end with a 500, the engine thread stays up and
    serves the next request (it used to escape `except Exception` and end the thread: every
    stream would have hung)."""
    PanicException = type("PanicException", (BaseException,), {})
    eng = FakeEngine()
    real_step, real_add = eng.step, eng.add_request
    panics = {"step": 1, "add": 1}

    def step():
        if panics["step"]:
            panics["step"] -= 1
            raise PanicException("index out of bounds")
        return real_step()

    def add_request(rid, prompt_ids, params):
        if rid == "bad" and panics["add"]:
            panics["add"] -= 1
            raise PanicException("end byte index is not a char boundary")
        real_add(rid, prompt_ids, params)

    eng.step, eng.add_request = step, add_request
    loop = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.0)
    try:
        async def items_of(rid, n):
            got = []
            async for items in loop.generate(rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=n)):
                got += items
            return got

        async def main():
            first = await asyncio.wait_for(items_of("r0", 3), 10)  # its step panics
            bad = await asyncio.wait_for(items_of("bad", 3), 10)  # its add panics
            after = await asyncio.wait_for(_collect(loop, "r1", 3), 10)
            return first, bad, after

        first, bad, after = asyncio.run(main())
        assert [getattr(i, "status_code", None) for i in first] == [500]
        assert [getattr(i, "status_code", None) for i in bad] == [500]
        assert after == [100, 101, 102] and loop.alive()
    finally:
        loop.shutdown()


def test_tokens_per_s_counts_the_last_window_of_steps_and_keeps_few_entries():
    """The rate a replica reports: the tokens of its steps in the last `window_s`, from a window
    of one entry per 10 ms kept for 5 s (not an entry per step, rebuilt every step)."""
    from keyacc_ray.serve import engine_loop

    eng = FakeEngine()
    loop = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.0)
    try:
        async def main():
            return await asyncio.wait_for(asyncio.gather(*(_collect(loop, f"r{i}", 150) for i in range(4))), 20)
        t0 = time.monotonic()
        asyncio.run(main())
        took = time.monotonic() - t0
        rate = loop.tokens_per_s(window_s=2.0)
        if took < 2.0:  # the whole run inside the window: every token counted, over 2 s
            assert rate == 600 / 2.0
        assert 0 < rate <= 600 / 2.0
        window = list(loop._tps_window)
        assert sum(n for _, n in window) == 600 or took > engine_loop.TPS_KEEP_S
        assert len(window) <= took / engine_loop.TPS_BUCKET_S + 2 and len(window) < 150  # fewer than the steps
    finally:
        loop.shutdown()


def test_a_slow_step_is_logged_with_its_share_of_a_core(monkeypatch, caplog):
    """A step over SLOW_STEP_S is counted and logged, with how much of it the engine thread ran
    (a sleeping step: a starved thread's share, near 0%), at most once per SLOW_STEP_LOG_EVERY_S."""
    import keyacc_ray.serve.engine_loop as el

    monkeypatch.setattr(el, "SLOW_STEP_S", 0.05)
    eng = FakeEngine()  # (no scheduler, as the benchmarks' stand-in engine: logged without its figures)
    quiet = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.0)
    try:
        real = eng.step
        eng.step = lambda: time.sleep(0.06) or real()
        assert asyncio.run(asyncio.wait_for(_collect(quiet, "q", 2), 10)) == [100, 101] and quiet.slow_steps == 2
    finally:
        quiet.shutdown()
    caplog.clear()
    eng = FakeEngine()
    eng.scheduler = type("S", (), {"num_running": 1, "num_waiting": 0, "num_preemptions": 0})()
    real_step = eng.step
    eng.step = lambda: time.sleep(0.06) or real_step()
    loop = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.0)
    try:
        with caplog.at_level("WARNING", logger=el.__name__):
            assert asyncio.run(asyncio.wait_for(_collect(loop, "r", 3), 10)) == [100, 101, 102]
        assert loop.slow_steps == 3
        logged = [r.getMessage() for r in caplog.records if "engine step took" in r.getMessage()]
        assert len(logged) == 1 and "1 running" in logged[0], logged
        share = int(logged[0].split("a core ")[1].split("%")[0])
        assert share < 50, logged  # it slept: the thread had no need of a core
    finally:
        loop.shutdown()


def test_a_stream_ends_with_where_its_tokens_waited_in_the_replica():
    """`timings=True`: the stream's last item is its HopTimings: the longest wait between two of its
    tokens leaving the engine's steps (here one slow step after the 5th token) and after how many
    tokens it began, and the longest its tokens waited for the event loop after the engine thread
    handed them over (here the loop blocked once while the engine stepped on)."""
    from keyacc_ray.serve.messages import HopTimings

    class SlowStep(FakeEngine):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def step(self):
            self.steps += 1
            if self.steps == 6:  # between the 5th token and the 6th
                time.sleep(0.3)
            return super().step()

    eng = SlowStep()
    loop = AsyncEngine(eng, on_export=lambda p: p, stream_interval_s=0.0)
    try:
        async def main():
            items, blocked = [], False
            async for batch in loop.generate("a", prompt_ids=[1, 2], params=SamplingParams(max_tokens=30),
                                             timings=True):
                items += batch
                got = sum(len(i.token_ids) for i in items if isinstance(i, TokenChunk))
                if got >= 10 and not blocked:  # the event loop held up while the engine goes on
                    blocked = True
                    time.sleep(0.2)
            plain = [i async for b in loop.generate("b", prompt_ids=[1], params=SamplingParams(max_tokens=3))
                     for i in b]
            return items, plain
        items, plain = asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        loop.shutdown()
    t = items[-1]
    assert isinstance(t, HopTimings) and all(isinstance(i, TokenChunk) for i in items[:-1])
    assert sum(len(i.token_ids) for i in items[:-1]) == 30
    assert 300 <= t.made_gap_ms < 1000 and t.made_gap_after == 5
    assert 150 <= t.loop_lag_ms < 1000
    assert all(isinstance(i, TokenChunk) for i in plain)  # without timings: no such item


def test_the_trace_keeps_each_segments_longest_waits():
    """Trace.hop_timings: a segment's longest engine gap (with its place) and event-loop lag over
    its hops; token_gap: its longest wait at the ingress and when it began."""
    from keyacc_ray.serve.messages import HopTimings, SegmentStart, Trace

    tr = Trace()
    tr.start(SegmentStart("cpu", "decode", "r1", "CpuDecode"))
    tr.hop_timings(HopTimings(120.0, 7, 3.0))
    tr.start(SegmentStart("cpu", "decode", "r1", "CpuDecode"))  # its next period: the same segment
    tr.hop_timings(HopTimings(80.0, 30, 9.5))
    tr.token_gap(0.05, 1.0)
    tr.token_gap(0.25, 2.5)
    tr.token_gap(0.1, 3.0)
    seg = tr.segments[0]
    assert (seg["made_gap_ms"], seg["made_gap_after"], seg["loop_lag_ms"]) == (120.0, 7, 9.5)
    assert (seg["ingress_gap_ms"], seg["ingress_gap_at_ms"]) == (250.0, 2500.0)
    tr.start(SegmentStart("gpu", "decode", "g1", "GpuDecode"))
    assert "made_gap_ms" not in tr.segments[1] and "ingress_gap_ms" not in tr.segments[1]
