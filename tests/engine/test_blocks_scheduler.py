"""Block accounting and scheduling: plain Python, no model."""
from keyacc_ray.engine.blocks import BlockManager
from keyacc_ray.engine.request import SamplingParams, Sequence, SeqStatus
from keyacc_ray.engine.scheduler import Scheduler


def seq(rid, n_prompt, max_tokens):
    return Sequence(rid, list(range(n_prompt)), n_prompt, SamplingParams(max_tokens=max_tokens))


def ran(out):
    """What the engine does after the step's forward: the fed tokens are cached; a sequence
    whose prompt is all in gets a sampled token."""
    for s, n in [(s, 1) for s in out.decode] + out.prefill:
        s.num_cached += n
        if s.num_cached == s.num_tokens:
            s.token_ids.append(1)
    return out


def test_block_manager_reserves_and_frees():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.blocks_for(1) == 1 and bm.blocks_for(16) == 1 and bm.blocks_for(17) == 2
    assert bm.allocate("a", 33)  # 3 blocks
    assert bm.num_free_blocks == 1
    assert not bm.allocate("b", 17)  # 2 blocks do not fit: a value, not an exception
    assert bm.num_free_blocks == 1 and bm.block_table("b") == []
    assert len(set(bm.block_table("a"))) == 3
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert bm.allocate("b", 64)


def test_scheduler_admits_fcfs_within_blocks_and_slots():
    bm = BlockManager(num_blocks=6, block_size=4)
    sch = Scheduler(bm, max_num_seqs=2, max_waiting=3, max_prefill_tokens=100)
    a, b, c = seq("a", 4, 4), seq("b", 4, 4), seq("c", 2, 2)  # 2, 2, 1 blocks
    assert sch.add(a) and sch.add(b) and sch.add(c)
    assert not sch.add(seq("d", 1, 1))  # waiting queue bounded
    out = ran(sch.schedule())
    assert [s.request_id for s in out.admitted] == ["a", "b"]  # slot limit 2
    assert out.decode == [] and out.prefill == [(a, 4), (b, 4)]
    out = sch.schedule()
    assert out.admitted == [] and [s.request_id for s in out.decode] == ["a", "b"]
    sch.finish(a, SeqStatus.FINISHED_LENGTH)
    assert bm.num_free_blocks == 4
    out = sch.schedule()
    assert [s.request_id for s in out.admitted] == ["c"]


def test_head_of_line_waits_for_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_waiting=8, max_prefill_tokens=100)
    big, small = seq("big", 8, 8), seq("small", 1, 1)
    running = seq("r", 4, 4)
    sch.add(running)
    sch.schedule()
    sch.add(big)
    sch.add(small)
    assert sch.schedule().admitted == []  # big needs 4 blocks, 1 free; small may not overtake
    sch.finish(running, SeqStatus.FINISHED_STOPPED)
    assert sch.schedule().admitted == []  # 4 > 3 blocks: it can never fit (the engine rejects it up front)
    assert not sch.fits_ever(big) and sch.fits_ever(small)


def test_prefill_budget_chunks_prompts_beside_decodes():
    bm = BlockManager(num_blocks=100, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_waiting=8, max_prefill_tokens=10, lazy=True)
    s = [seq(f"s{i}", 6, 2) for i in range(4)]
    for x in s:
        sch.add(x)
    out = ran(sch.schedule())  # 6 + the first 4 of the next prompt: 10 prompt tokens a step
    # (a prompt admitted in chunks holds blocks for all of it at once: no preemption mid-prefill)
    assert out.prefill == [(s[0], 6), (s[1], 4)] and out.admitted == s[:2] and len(bm.block_table("s1")) == 2
    out = ran(sch.schedule())  # s1 goes on from token 4 first, then s2; s0 decodes beside them
    assert out.decode == [s[0]] and out.prefill == [(s[1], 2), (s[2], 6), (s[3], 2)] and out.admitted == s[2:]
    assert len(bm.block_table("s1")) == 2 and len(bm.block_table("s3")) == 2
    out = ran(sch.schedule())
    assert out.decode == [s[0], s[1], s[2]] and out.prefill == [(s[3], 4)]


def test_a_sequence_with_a_chunk_limit_feeds_no_more_a_step():
    bm = BlockManager(num_blocks=100, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_waiting=8, max_prefill_tokens=100, lazy=True)
    a = seq("a", 25, 2)
    a.max_chunk = 10
    sch.add(a)
    assert [n for _, n in ran(sch.schedule()).prefill] == [10]
    assert [n for _, n in ran(sch.schedule()).prefill] == [10]
    assert [n for _, n in ran(sch.schedule()).prefill] == [5]
    assert sch.schedule().decode == [a]


def test_status_order():
    assert not SeqStatus.RUNNING.finished and SeqStatus.FINISHED_LENGTH.finished
    assert SeqStatus.FINISHED_STOPPED.finish_reason == "stop"


def test_lazy_blocks_grow_and_the_newest_is_preempted():
    bm = BlockManager(num_blocks=5, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_waiting=8, max_prefill_tokens=100, lazy=True)
    a, b, c = seq("a", 4, 8), seq("b", 4, 8), seq("c", 5, 8)  # 1, 1, 2 blocks for their prompts
    for s in (a, b, c):
        sch.add(s)
    out = ran(sch.schedule())  # prefilled, one token sampled each: a and b now need a 2nd block
    assert out.admitted == [a, b, c] and bm.num_free_blocks == 1  # reserving, only a would fit
    out = sch.schedule()  # a grows into the last free block; b cannot: c (newest) is preempted
    assert out.preempted == [c] and out.decode == [a, b] and out.admitted == []
    assert len(out.preempted_tables["c"]) == 2  # where its KV still is this step (a move on preemption)
    c.num_cached = 0  # the engine: its KV is gone
    assert sch.waiting[0] is c and c.status == SeqStatus.WAITING
    assert len(bm.block_table("a")) == 2 and len(bm.block_table("b")) == 2 and bm.num_free_blocks == 1
    assert sch.num_preemptions == 1
    out = sch.schedule()  # nothing to grow: c (6 tokens, 2 blocks) waits for blocks
    assert out.preempted == [] and out.admitted == []
    sch.finish(a, SeqStatus.FINISHED_LENGTH)
    assert sch.schedule().admitted == [c] and len(bm.block_table("c")) == 2


def test_the_block_array_mirrors_every_table():
    """The array a step gathers its block tables from holds each running sequence's table in its
    row through allocation, growth and frees (rows reused); a table wider than a row has none
    (the step reads its list)."""
    import random

    bm = BlockManager(num_blocks=64, block_size=4, max_seqs=4, max_blocks_per_seq=6)
    rng = random.Random(0)
    live: dict[str, int] = {}
    for step in range(300):
        sid = f"s{rng.randrange(8)}"
        if sid in live and rng.random() < 0.3:
            bm.free(sid)
            del live[sid]
        elif sid in live:
            live[sid] += rng.randrange(1, 6)
            bm.grow(sid, live[sid])
        elif len(live) < 4:
            live[sid] = rng.randrange(1, 12)
            assert bm.allocate(sid, live[sid])
        for s in live:
            table = bm.tables[s]
            if len(table) <= 6:
                assert bm.array[bm.row[s], :len(table)].tolist() == table
            else:
                assert s not in bm.row
        assert len(set(bm.row.values())) == len(bm.row) and set(bm.row) <= set(live)
    for s in list(live):
        bm.free(s)
    assert not bm.row and sorted(bm._free_rows) == [0, 1, 2, 3]


def test_a_stream_under_way_queues_ahead_of_fresh_prompts():
    """A sequence that has generated tokens (a hand-off from another engine, a recovery) queues
    behind the others under way and ahead of every fresh prompt: its client waits between two
    tokens. Fresh prompts keep their order; so do the streams under way."""
    bm = BlockManager(num_blocks=64, block_size=4)
    sch = Scheduler(bm, max_num_seqs=1, max_waiting=10, max_prefill_tokens=100)
    running = seq("run", 4, 100)
    assert sch.add(running)
    ran(sch.schedule())  # takes the one slot: everything below waits
    fresh = [seq(f"f{i}", 4, 4) for i in range(3)]
    moved = []
    for i in range(2):
        m = seq(f"m{i}", 4, 8)
        m.token_ids += [7, 8]  # two tokens already streamed elsewhere
        moved.append(m)
    for s in (fresh[0], moved[0], fresh[1], moved[1], fresh[2]):
        assert sch.add(s)
    assert [s.request_id for s in sch.waiting] == ["m0", "m1", "f0", "f1", "f2"]
    sch.finish(running, SeqStatus.FINISHED_LENGTH)
    out = sch.schedule()
    assert [s.request_id for s in out.admitted] == ["m0"]


def test_a_full_waiting_queue_refuses_fresh_prompts_but_never_a_stream_under_way():
    """The waiting queue's bound is for new requests: a sequence whose client already has tokens
    (a hand-off, a recovery) is queued past it, ahead of the fresh prompts; fresh ones are still
    refused until the queue has room for them again."""
    bm = BlockManager(num_blocks=64, block_size=4)
    sch = Scheduler(bm, max_num_seqs=1, max_waiting=2, max_prefill_tokens=100)
    assert sch.add(seq("run", 4, 100))
    ran(sch.schedule())
    assert sch.add(seq("f0", 4, 4)) and sch.add(seq("f1", 4, 4))
    assert not sch.add(seq("f2", 4, 4))
    moved = seq("m0", 4, 8)
    moved.token_ids += [7, 8]
    assert sch.add(moved)
    assert [s.request_id for s in sch.waiting] == ["m0", "f0", "f1"]
    assert not sch.add(seq("f3", 4, 4))


def test_fresh_prompts_held_while_sequences_decode_until_the_hold_ends():
    """Prompt hold (vLLM v0's delay factor): after the engine sets hold_until, fresh prompts wait
    while sequences decode; a hand-off (a decode row) and a prompt's next chunk are not held; with
    nothing decoding nothing waits; once the hold ends the waiting prompts go in together."""
    now = [0.0]
    bm = BlockManager(num_blocks=100, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_waiting=8, max_prefill_tokens=6, lazy=True, clock=lambda: now[0])
    long, a = seq("long", 9, 4), seq("a", 3, 8)
    sch.add(a)
    sch.add(long)
    out = ran(sch.schedule())  # a whole, the first 3 tokens of `long`
    assert out.prefill == [(a, 3), (long, 3)]
    sch.hold_until = 1.0  # (the engine: after that step)
    b, c = seq("b", 3, 4), seq("c", 2, 4)
    moved = seq("m", 4, 8)
    moved.token_ids += [7]
    moved.num_cached = 4  # came with its KV: a decode row
    for s in (b, moved, c):
        sch.add(s)
    out = ran(sch.schedule())  # a decodes; long's next chunk goes on; the hand-off joins; b, c held
    assert out.decode == [a, moved] and out.prefill == [(long, 6)] and out.admitted == [moved]
    assert [s.request_id for s in sch.waiting] == ["b", "c"] and sch.num_held == 1
    now[0] = 0.5
    assert not ran(sch.schedule()).admitted  # still held
    now[0] = 1.0
    out = ran(sch.schedule())  # the hold is over: both prompts in one step
    assert out.admitted == [b, c] and out.prefill == [(b, 3), (c, 2)]
    # nothing decoding: a fresh prompt is never held
    bm2 = BlockManager(num_blocks=20, block_size=4)
    idle = Scheduler(bm2, max_num_seqs=4, max_waiting=4, max_prefill_tokens=16, clock=lambda: 0.0)
    idle.hold_until = 5.0
    d = seq("d", 3, 2)
    idle.add(d)
    assert idle.schedule().admitted == [d]


def _drive(growth_reserve: bool, arrivals: int = 24, blocks: int = 40):
    """A closed loop over a small lazy pool: 8 clients, prompts of 100-200 tokens generating 20-120
    (max_tokens 160: they end before it); the engine's side as `ran` does, preempted sequences'
    KV dropped. Returns (preemptions, steps, finished)."""
    import random

    from keyacc_ray.engine.scheduler import GrowthReserve

    rng = random.Random(5)
    bm = BlockManager(num_blocks=blocks, block_size=16)
    sch = Scheduler(bm, max_num_seqs=8, max_waiting=64, max_prefill_tokens=512, lazy=True,
                    growth_reserve=growth_reserve)
    assert isinstance(sch.growth, GrowthReserve) == growth_reserve
    stop, sent, done, steps = {}, 0, 0, 0

    def send():
        nonlocal sent
        s = seq(f"r{sent}", rng.randint(100, 200), 160)
        stop[s.request_id] = rng.randint(20, 120)
        sent += 1
        assert sch.add(s)

    for _ in range(8):
        send()
    while done < arrivals:
        steps += 1
        assert steps < 20_000
        out = ran(sch.schedule())
        for s in out.preempted:
            s.num_cached = 0
        for s in list(sch.running):
            if s.num_output_tokens >= stop[s.request_id]:
                sch.finish(s, SeqStatus.FINISHED_STOPPED)
                done += 1
                if sent < arrivals:
                    send()
    assert not sch.running and bm.num_free_blocks == blocks
    return sch.num_preemptions, steps, done


def test_a_growth_reserve_admits_with_room_to_grow_and_preempts_far_less():
    """Lazy KV fills the pool at admission and the running sequences' next tokens then preempt
    the newest, over and over; with the growth reserve (SGLang's new-token ratio) the same load
    preempts a fraction as often and still finishes every request, in about as many steps."""
    lazy = _drive(False, arrivals=48)
    reserved = _drive(True, arrivals=48)
    assert lazy[2] == reserved[2] == 48
    assert lazy[0] >= 10 and reserved[0] * 3 <= lazy[0], (lazy, reserved)
    assert reserved[1] <= 1.5 * lazy[1], (lazy, reserved)


def test_the_growth_reserve_ratio_decays_and_comes_back_after_a_preemption():
    from keyacc_ray.engine.scheduler import GrowthReserve

    g = GrowthReserve()
    for _ in range(10_000):
        g.stepped(False)
    assert g.ratio == GrowthReserve.MIN
    g.stepped(True)
    assert g.ratio == GrowthReserve.INIT
    bm = BlockManager(num_blocks=100, block_size=16)
    s = seq("a", 100, 1000)  # 7 blocks now; 0.7 x 1000 more tokens: 800 in all, 50 blocks
    assert g.need(s, 7, bm) == 50 - 7
    # with nothing running a sequence is admitted whatever it may need
    sch = Scheduler(bm, max_num_seqs=4, max_waiting=4, max_prefill_tokens=512, lazy=True, growth_reserve=True)
    big = seq("big", 200, 100_000)
    sch.add(big)
    assert sch.schedule().admitted == [big]
    small = seq("small", 20, 16)
    sch.add(small)
    assert sch.schedule().admitted == [] and sch.growth.refused == 1  # big may grow into all of it
