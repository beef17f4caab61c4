"""Offload policies with a fake clock and hand-built load views: no Ray, no model."""
import pytest

from keyacc_ray.policies import LoadView, PoolLoad, RequestView, make_policy
from keyacc_ray.policies.hysteresis import Debounced


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def view(gpu_queue=0, cpu_queue=0, prefill_queue=0, free_blocks=100, gpu_mem=None):
    return LoadView(gpu_prefill=PoolLoad(queue=prefill_queue, free_blocks=100, known=True),
                    gpu_decode=PoolLoad(queue=gpu_queue, free_blocks=free_blocks, total_blocks=100, known=True),
                    cpu=PoolLoad(queue=cpu_queue, free_blocks=100, known=True), gpu_mem_free_bytes=gpu_mem)


REQ = RequestView(num_prompt_tokens=20, num_output_tokens=0, max_tokens=40)  # 60 tokens: 4 blocks of 16


def drive(policy, clock, load_fn, seconds, dt=0.05):
    """Advance the clock, observing load_fn(t) at each tick; returns the routes chosen."""
    routes = []
    end = clock.t + seconds
    while clock.t < end:
        routes.append(policy.route(REQ, load_fn(clock.t)))
        clock.t += dt
    return routes


@pytest.mark.parametrize("name", ["full_offload", "stage_offload", "auto"])
def test_square_wave_shorter_than_window_never_switches(name):
    clock = Clock()
    p = make_policy(name, {"trigger_window_s": 1.0, "return_window_s": 2.0}, clock=clock)
    # overload for 0.4 s, calm for 0.4 s, repeated for 10 s: every burst ends before the window
    wave = lambda t: view(gpu_queue=10 if (t % 0.8) < 0.4 else 0, prefill_queue=10 if (t % 0.8) < 0.4 else 0)  # noqa
    routes = drive(p, clock, wave, 10)
    assert set(routes) == {"gpu"}
    assert p.after_prefill(REQ, wave(0.1)) == "gpu"
    gates = [g for g in (getattr(p, a, None) for a in ("gpu", "decode")) if g is not None]
    assert gates[0].flag.flips == 0 and gates[0].flag.suppressed >= 10


def test_full_offload_sustained_overload_switches_within_one_window_and_returns():
    clock = Clock()
    p = make_policy("full_offload", {"trigger_window_s": 1.0, "return_window_s": 2.0}, clock=clock)
    routes = drive(p, clock, lambda t: view(gpu_queue=10), 1.2)
    first_cpu = routes.index("cpu")
    assert 0.9 <= first_cpu * 0.05 <= 1.05  # within one window of the overload starting
    # a momentary dip does not bring requests back
    routes = drive(p, clock, lambda t: view(gpu_queue=0), 0.5) + drive(p, clock, lambda t: view(gpu_queue=10), 0.5)
    assert set(routes) == {"cpu"}
    # sustained calm: back to the GPU after the return window
    routes = drive(p, clock, lambda t: view(gpu_queue=0), 2.5)
    back = routes.index("gpu")
    assert 1.9 <= back * 0.05 <= 2.1 and set(routes[back:]) == {"gpu"}


def test_full_offload_cpu_gate_keeps_requests_on_gpu_when_cpu_is_full():
    clock = Clock()
    p = make_policy("full_offload", {"trigger_window_s": 0.2, "return_window_s": 1.0, "max_hold_s": 0}, clock=clock)
    routes = drive(p, clock, lambda t: view(gpu_queue=10, cpu_queue=10), 1.0)
    assert routes[-1] == "gpu"


def test_full_offload_flood_overflows_at_once_but_a_small_spike_waits_the_window():
    clock = Clock()
    p = make_policy("full_offload", {"trigger_window_s": 0.5, "return_window_s": 1.0}, clock=clock)
    assert p.route(REQ, view(gpu_queue=4)) == "gpu"  # above high, within the window: no flip yet
    assert p.route(REQ, view(gpu_queue=30)) == "cpu"  # a flood: beyond gpu_queue_overflow (24) now
    assert p.counters["overflow_to_cpu"] == 1
    assert p.route(REQ, view(gpu_queue=0)) == "gpu"


def test_full_offload_both_overloaded_queues_where_it_drains_sooner():
    """Not held (max_hold_s 0, or held as long as it may be): it queues on a pool."""
    clock = Clock()
    p = make_policy("full_offload", {"trigger_window_s": 0.2, "return_window_s": 1.0, "max_hold_s": 0}, clock=clock)

    def loaded(gpu_q, cpu_q, gpu_tps, cpu_tps):
        v = view(gpu_queue=gpu_q, cpu_queue=cpu_q)
        v.gpu_decode.tokens_per_s, v.cpu.tokens_per_s = gpu_tps, cpu_tps
        return lambda t: v

    # GPU: 30 queued at 100 tok/s (0.3 s); CPU: 6 queued at 200 tok/s (0.03 s) -> CPU
    assert drive(p, clock, loaded(30, 6, 100.0, 200.0), 1.0)[-1] == "cpu"
    assert p.counters.get("both_overloaded_to_cpu", 0) > 0
    # a fast GPU with the same queues works them off sooner -> GPU
    assert drive(p, clock, loaded(30, 6, 5000.0, 200.0), 0.5)[-1] == "gpu"
    # rates not known yet: the GPU, as before
    assert drive(p, clock, loaded(30, 6, 0.0, 0.0), 0.5)[-1] == "gpu"


def test_return_blocked_by_memory_check_waits_then_happens():
    clock = Clock()
    p = make_policy("full_offload", {"trigger_window_s": 0.2, "return_window_s": 0.5}, clock=clock)
    mid = RequestView(20, 16, 40)  # reserves 60 tokens = 4 blocks on the GPU
    drive(p, clock, lambda t: view(gpu_queue=10), 0.5)
    assert p.after_period(mid, view(gpu_queue=10)) == "cpu"  # still overloaded
    drive(p, clock, lambda t: view(gpu_queue=0, free_blocks=3), 1.0)  # calm, but only 3 free blocks
    assert not p.gpu.overloaded
    assert p.after_period(mid, view(gpu_queue=0, free_blocks=3)) == "cpu"
    assert p.counters["moves_refused_memory"] == 1
    # the engine's free blocks decide: pynvml's free memory (a preallocated pool never moves it) does not
    assert p.after_period(mid, view(gpu_queue=0, free_blocks=4, gpu_mem=100)) == "gpu"
    assert p.after_period(mid, view(gpu_queue=0, free_blocks=3, gpu_mem=80 << 30)) == "cpu"
    assert p.after_period(mid, view(gpu_queue=0, free_blocks=4)) == "gpu"


def drive_handoff(policy, clock, load_fn, seconds, dt=0.05):
    out = []
    end = clock.t + seconds
    while clock.t < end:
        assert policy.route(REQ, load_fn(clock.t)) == "gpu"  # prefill always on the GPU
        out.append(policy.after_prefill(RequestView(20, 1, 40), load_fn(clock.t)))
        clock.t += dt
    return out


def test_stage_offload_periods_and_migration_back():
    clock = Clock()
    p = make_policy("stage_offload", {"trigger_window_s": 0.3, "return_window_s": 1.0,
                                      "decode_period_tokens": 8}, clock=clock)
    assert p.decode_period_tokens() == 8
    assert drive_handoff(p, clock, lambda t: view(gpu_queue=0), 0.5)[-1] == "gpu"
    places = drive_handoff(p, clock, lambda t: view(gpu_queue=5), 0.5)
    assert places[-1] == "cpu" and places[0] == "gpu"  # switched within the window, not at once
    req = RequestView(20, 8, 40)
    assert p.after_period(req, view(gpu_queue=5)) == "cpu"
    drive(p, clock, lambda t: view(gpu_queue=0), 1.1)
    assert p.after_period(req, view(gpu_queue=0)) == "gpu"
    # a request whose KV cannot fit on the GPU decode pool now decodes on the CPU, no queue needed
    assert p.after_prefill(RequestView(20, 1, 400), view(gpu_queue=0, free_blocks=10)) == "cpu"
    assert p.counters["decode_offloaded_memory"] == 1


def test_auto_picks_stage_or_whole_request_by_prefill_load():
    clock = Clock()
    p = make_policy("auto", {"trigger_window_s": 0.2, "return_window_s": 1.0}, clock=clock)
    decode_busy = lambda t: view(gpu_queue=5, prefill_queue=0)  # noqa: E731
    assert drive(p, clock, decode_busy, 0.4)[-1] == "gpu"  # prefill keeps up: prefill on the GPU ...
    assert p.after_prefill(RequestView(20, 1, 40), decode_busy(0)) == "cpu"  # ... decode on the CPU
    assert drive(p, clock, lambda t: view(gpu_queue=8, prefill_queue=5), 0.4)[-1] == "cpu"  # whole request
    assert drive(p, clock, lambda t: view(gpu_queue=0, prefill_queue=0), 1.3)[-1] == "gpu"
    assert p.after_prefill(RequestView(20, 1, 40), view()) == "gpu"


def test_auto_flood_overflows_whole_requests_at_once_and_both_full_queues_where_it_drains_sooner():
    clock = Clock()
    p = make_policy("auto", {"trigger_window_s": 0.5, "return_window_s": 1.0, "max_hold_s": 0}, clock=clock)
    assert p.route(REQ, view(gpu_queue=4, prefill_queue=4)) == "gpu"  # above high, within the window
    assert p.route(REQ, view(gpu_queue=30, prefill_queue=30)) == "cpu"  # a burst beyond gpu_queue_overflow
    assert p.counters["overflow_to_cpu"] == 1

    def loaded(gpu_tps, cpu_tps):
        v = view(gpu_queue=30, prefill_queue=30, cpu_queue=6)
        v.gpu_decode.tokens_per_s, v.cpu.tokens_per_s = gpu_tps, cpu_tps
        return lambda t: v

    # both pools overloaded: the one that works its queue off sooner
    assert drive(p, clock, loaded(100.0, 200.0), 1.0)[-1] == "cpu"
    assert drive(p, clock, loaded(5000.0, 200.0), 0.5)[-1] == "gpu"


def test_gpu_only_and_unknown_policy():
    assert make_policy("gpu_only").route(REQ, view(gpu_queue=100)) == "gpu"
    with pytest.raises(ValueError, match="known"):
        make_policy("nope")
    with pytest.raises(ValueError, match="unknown options"):
        make_policy("full_offload", {"gpu_queue_hi": 3})


def test_debounced_counts_suppressed_episodes():
    d = Debounced(1.0, 1.0)
    d.update(True, False, 0.0)
    d.update(False, False, 0.5)
    d.update(True, False, 0.6)
    assert d.update(True, False, 1.7) and d.suppressed == 1 and d.flips == 1


@pytest.mark.parametrize("name", ["full_offload", "auto"])
def test_flood_limit_is_one_gpu_batch_when_that_is_less_than_the_option(name):
    clock = Clock()
    p = make_policy(name, {"trigger_window_s": 5.0}, clock=clock)

    def small_gpu(queue, slots=8):
        v = view(gpu_queue=queue, prefill_queue=0)
        v.gpu_decode.total_blocks, v.gpu_decode.slots = 16, slots  # KV for 4 requests of REQ's size
        return v
    assert p.route(REQ, small_gpu(4)) == "gpu"  # one batch waits: within the trigger window, no flip
    assert p.route(REQ, small_gpu(5)) == "cpu"  # more than one batch: overflow at once
    assert p.route(REQ, small_gpu(3, slots=2)) == "cpu"  # two sequence slots bind before the KV does
    assert p.route(RequestView(20, 0, 120), small_gpu(2)) == "cpu"  # KV for one request this size
    assert p.counters["overflow_to_cpu"] == 3


@pytest.mark.parametrize("name", ["full_offload", "auto"])
def test_a_colocated_gpu_engines_requests_count_once(name):
    """With one GPU engine for both phases (the default graph) the view's prefill load is the
    decode load: its requests in flight are counted once in the flood limit and the places left
    (they were counted twice: on the simulated L40S scenario every request beyond half a batch
    overflowed to the CPU pool while the GPU had room for it)."""
    clock = Clock()
    p = make_policy(name, {"trigger_window_s": 5.0, "max_hold_s": 0}, clock=clock)
    gpu = PoolLoad(queue=0, free_blocks=400, total_blocks=400, slots=256, inflight=30, known=True)  # batch: 100
    v = LoadView(gpu_prefill=gpu, gpu_decode=gpu, cpu=PoolLoad(slots=64, inflight=64, free_blocks=100, known=True),
                 colocated=True)
    assert v.gpu_inflight == 30 and p.route(REQ, v) == "gpu"
    gpu.inflight = 90  # within one batch: room for 10
    assert p.route(REQ, v) == "gpu"
    gpu.inflight = 130  # more than a batch waits (100 + the limit of 24 exceeded): overflow
    assert p.route(REQ, v) == "cpu"
    split = LoadView(gpu_prefill=PoolLoad(inflight=30, known=True), gpu_decode=PoolLoad(
        free_blocks=400, total_blocks=400, slots=256, inflight=95, known=True), cpu=v.cpu)
    assert split.gpu_inflight == 125 and p.route(REQ, split) == "cpu"  # two engines: both phases count


@pytest.mark.parametrize("name", ["full_offload", "auto"])
def test_a_whole_request_goes_to_the_cpu_only_if_its_prompt_goes_through_there_in_time(name):
    """The GPU flooded: a request would overflow whole to the CPU pool, but there its prompt would
    take prompt tokens / the pool's measured prefill rate; beyond cpu_prefill_max_s it stays on the
    GPU (auto then places its decode at the hand-off). Unknown rate or limit 0: as before."""
    p = make_policy(name, {"trigger_window_s": 5.0}, clock=Clock())

    def flooded(cpu_rate):
        v = view(gpu_queue=40)  # beyond gpu_queue_overflow: overflow at once
        v.cpu.prefill_tokens_per_s = cpu_rate
        return v
    long_prompt = RequestView(num_prompt_tokens=800, num_output_tokens=0, max_tokens=40)
    assert p.route(long_prompt, flooded(0.0)) == "cpu"  # not measured yet
    assert p.route(long_prompt, flooded(1000.0)) == "cpu"  # 0.8 s
    assert p.route(long_prompt, flooded(400.0)) == "gpu"  # 2 s
    assert p.route(REQ, flooded(400.0)) == "cpu"  # a 20-token prompt: 0.05 s
    assert p.counters["cpu_prefill_too_slow"] == 1
    # the CPU pool likely caches its head (the router's guess): only the rest is computed there
    cached_head = RequestView(num_prompt_tokens=800, num_output_tokens=0, max_tokens=40, cpu_cached_tokens=640)
    assert p.route(cached_head, flooded(400.0)) == "cpu"  # 160 tokens: 0.4 s
    assert make_policy(name, {"cpu_prefill_max_s": 0}).route(long_prompt, flooded(400.0)) == "cpu"  # no limit
    assert make_policy(name, {"cpu_prefill_max_s": 3.0}).route(long_prompt, flooded(400.0)) == "cpu"
    for bad in (-1, "fast", None):
        with pytest.raises(ValueError, match="cpu_prefill_max_s"):
            make_policy(name, {"cpu_prefill_max_s": bad})


@pytest.mark.parametrize("name", ["full_offload", "auto"])
def test_new_requests_leave_the_cpu_places_reserved_for_streams_under_way(name):
    """cpu_reserved_places: a new whole request does not take the CPU pool's last places (a GPU
    decode preempted out of KV moves there mid-stream and would wait for a place); it waits at
    the router (max_hold_s) or queues on the GPU. Off (0) by default; slots unknown: no limit."""
    def flooded(cpu_inflight, slots=32):
        v = view(gpu_queue=40)
        v.cpu.slots, v.cpu.inflight = slots, cpu_inflight
        return v
    p = make_policy(name, {"trigger_window_s": 5.0, "cpu_reserved_places": 4}, clock=Clock())
    assert p.route(REQ, flooded(27)) == "cpu"  # 27 + 4 < 32
    assert p.route(REQ, flooded(28)) == "gpu"  # the last 4 are kept
    assert p.route(REQ, flooded(28, slots=0)) == "cpu"  # the pool's slots not known yet
    assert p.counters["cpu_places_reserved"] == 1
    held = make_policy(name, {"trigger_window_s": 5.0, "cpu_reserved_places": 4, "max_hold_s": 2.0}, clock=Clock())
    assert held.route(REQ, flooded(28)) == "hold"
    assert make_policy(name, {"trigger_window_s": 5.0}).route(REQ, flooded(31)) == "cpu"  # off by default
    with pytest.raises(ValueError, match="cpu_reserved_places"):
        make_policy(name, {"cpu_reserved_places": -2})


@pytest.mark.parametrize("name", ["full_offload", "auto"])
def test_no_request_queues_on_the_cpu_while_the_gpu_has_room(name):
    """The GPU gate is on (sustained overload), but right now nothing waits on the GPU and a
    decode batch has a free place, while the CPU pool's slots are all taken: the GPU, at once."""
    clock = Clock()
    p = make_policy(name, {"trigger_window_s": 0.2, "return_window_s": 5.0, "max_hold_s": 0}, clock=clock)
    drive(p, clock, lambda t: view(gpu_queue=10, prefill_queue=10), 0.5)  # the gate flips on

    def now(gpu_inflight, cpu_inflight, cpu_queue=0):
        v = view(gpu_queue=0, free_blocks=16)
        v.gpu_decode.total_blocks, v.gpu_decode.slots, v.gpu_decode.inflight = 16, 8, gpu_inflight  # batch: 4
        v.cpu.slots, v.cpu.inflight, v.cpu.queue = 32, cpu_inflight, cpu_queue
        return v
    assert p.route(REQ, now(gpu_inflight=2, cpu_inflight=10)) == "cpu"  # the CPU has room: the gate decides
    assert p.route(REQ, now(gpu_inflight=2, cpu_inflight=32)) == "gpu"  # CPU slots full, GPU room: no wait
    assert p.route(REQ, now(gpu_inflight=2, cpu_inflight=20, cpu_queue=3)) == "gpu"
    assert p.route(REQ, now(gpu_inflight=4, cpu_inflight=32)) == "cpu"  # the GPU batch is full too
    big = RequestView(20, 0, 400)  # its KV does not fit the GPU now
    assert p.route(big, now(gpu_inflight=0, cpu_inflight=32)) == "cpu"
    assert p.counters["gpu_room_over_cpu_queue"] == 2


@pytest.mark.parametrize("name", ["full_offload", "auto"])
def test_a_request_with_no_place_on_either_pool_is_held_then_queues(name):
    """The CPU pool full and the GPU without room: HOLD (it waits at the router for the first
    place either pool frees) until it has been held `max_hold_s`, then it queues on a pool as
    before. A place on either pool ends the hold; where the CPU has room the gate decides."""
    clock = Clock()
    p = make_policy(name, {"trigger_window_s": 0.2, "return_window_s": 5.0, "max_hold_s": 2.0}, clock=clock)
    drive(p, clock, lambda t: view(gpu_queue=10, prefill_queue=10), 0.5)  # the gate flips on

    def now(gpu_inflight, cpu_inflight, cpu_queue=0, gpu_queue=0):
        v = view(gpu_queue=gpu_queue, prefill_queue=gpu_queue, free_blocks=16)
        v.gpu_decode.total_blocks, v.gpu_decode.slots, v.gpu_decode.inflight = 16, 8, gpu_inflight  # batch: 4
        v.cpu.slots, v.cpu.inflight, v.cpu.queue = 32, cpu_inflight, cpu_queue
        return v
    held = lambda s: RequestView(20, 0, 40, held_s=s)  # noqa: E731
    assert p.route(REQ, now(gpu_inflight=4, cpu_inflight=32)) == "hold"
    assert p.route(held(1.9), now(gpu_inflight=4, cpu_inflight=32, cpu_queue=2, gpu_queue=3)) == "hold"
    assert p.route(held(1.9), now(gpu_inflight=3, cpu_inflight=32)) == "gpu"  # a GPU place freed
    assert p.route(held(1.9), now(gpu_inflight=4, cpu_inflight=31)) == "cpu"  # a CPU place freed
    assert p.route(held(2.0), now(gpu_inflight=4, cpu_inflight=32)) in ("gpu", "cpu")  # held long enough
    with pytest.raises(ValueError, match="max_hold_s"):
        make_policy(name, {"max_hold_s": 60})
    assert make_policy("stage_offload", {}).route(REQ, now(gpu_inflight=4, cpu_inflight=32)) != "hold"
    assert make_policy("gpu_only", {}).route(REQ, now(gpu_inflight=4, cpu_inflight=32)) == "gpu"


@pytest.mark.parametrize("name, recalls", [("full_offload", True), ("auto", True), ("stage_offload", False),
                                           ("gpu_only", False)])
def test_recall_from_the_cpu_queue_up_to_the_gpu_places(name, recalls):
    """Requests waiting for a CPU slot start over on the GPU when it frees up first: as many as
    its decode batch has places (this router's in-flight requests counted), none while anything
    waits there or the memory check fails. Off (the default, and policies that never send whole
    requests to the CPU): None, so that the pools need not ask."""
    p = make_policy(name, {"recall_queued": True} if recalls else {}, clock=Clock())

    def now(gpu_inflight, gpu_queue=0, free_blocks=16):
        v = view(gpu_queue=gpu_queue, free_blocks=free_blocks)
        v.gpu_decode.total_blocks, v.gpu_decode.slots, v.gpu_decode.inflight = 16, 8, gpu_inflight  # batch: 4
        return v
    waiting = [REQ] * 3
    if not recalls:
        assert p.recall(waiting, now(gpu_inflight=0)) is None
        return
    assert p.recall(waiting, now(gpu_inflight=0)) == 3
    assert p.recall(waiting, now(gpu_inflight=2)) == 2
    assert p.recall(waiting, now(gpu_inflight=4)) == 0
    assert p.recall(waiting, now(gpu_inflight=0, gpu_queue=1)) == 0
    assert p.recall(waiting, now(gpu_inflight=0, free_blocks=1)) == 0  # its KV does not fit there now
    assert p.recall([], now(gpu_inflight=0)) == 0
    assert make_policy(name, {}, clock=Clock()).recall(waiting, now(gpu_inflight=0)) is None  # off by default


@pytest.mark.parametrize("name", ["stage_offload", "auto"])
def test_a_prefilled_stream_moves_only_to_a_free_cpu_place(name):
    """After its prefill a request has streamed its first token: under GPU overload (or short of
    GPU memory) its decode moves to the CPU pool only while that pool has a free place; with every
    place taken (or anything queued there) it decodes on the GPU, where it already runs."""
    clock = Clock()
    p = make_policy(name, {"trigger_window_s": 0.2, "return_window_s": 1.0}, clock=clock)

    def busy(cpu_inflight, cpu_queue=0, free_blocks=100):
        v = view(gpu_queue=5, free_blocks=free_blocks)
        v.cpu = PoolLoad(queue=cpu_queue, slots=16, inflight=cpu_inflight, free_blocks=100, known=True)
        return v

    drive(p, clock, lambda t: busy(0), 0.4)  # the GPU decode pool overloaded past the window
    req = RequestView(20, 1, 40)
    assert p.after_prefill(req, busy(15)) == "cpu"
    assert p.after_prefill(req, busy(16)) == "gpu"
    assert p.after_prefill(req, busy(3, cpu_queue=1)) == "gpu"
    assert p.counters["decode_kept_cpu_full"] == 2
    clock.t += 5  # calm again; short of GPU memory, the same rule
    drive(p, clock, lambda t: view(), 1.5)
    assert p.after_prefill(RequestView(20, 1, 400), busy(15, free_blocks=10)) == "cpu"
    assert p.after_prefill(RequestView(20, 1, 400), busy(16, free_blocks=10)) == "gpu"


@pytest.mark.parametrize("name", ["stage_offload", "auto"])
def test_a_cpu_decode_moves_back_only_to_a_free_gpu_place(name):
    """After a CPU period, with the GPU calm again and memory to spare, the decode moves back only
    if the GPU decode pool has a free place now."""
    clock = Clock()
    p = make_policy(name, {"trigger_window_s": 0.2, "return_window_s": 0.5}, clock=clock)
    drive(p, clock, lambda t: view(), 1.0)

    def calm(inflight, slots=8):
        v = view()
        v.gpu_decode = PoolLoad(queue=max(0, inflight - slots), slots=slots, inflight=inflight, free_blocks=100,
                                total_blocks=100, known=True)
        return v

    req = RequestView(20, 8, 40)
    assert p.after_period(req, calm(7)) == "gpu"
    assert p.after_period(req, calm(8)) == "cpu"
    assert p.counters["moves_kept_gpu_full"] == 1


@pytest.mark.parametrize("name", ["full_offload", "auto"])
def test_a_new_request_goes_to_the_pool_whose_queue_is_not_at_its_bound(name):
    """A pool's replicas refuse a fresh prompt once their waiting queues hold `max_waiting` (a
    503); with the other pool's queue below its bound the request queues there instead, whatever
    the drain times say. Bounds not known (0), or both at theirs: as before."""
    clock = Clock()
    p = make_policy(name, {"trigger_window_s": 0.2, "return_window_s": 5.0, "max_hold_s": 0}, clock=clock)
    drive(p, clock, lambda t: view(gpu_queue=30, prefill_queue=30, cpu_queue=6), 0.5)  # both gates flip on

    def now(gpu_q, cpu_q, gpu_bound, cpu_bound):
        v = view(gpu_queue=gpu_q, prefill_queue=gpu_q, cpu_queue=cpu_q)
        v.gpu_decode.tokens_per_s, v.cpu.tokens_per_s = 100.0, 200.0  # the CPU drains sooner
        v.gpu_prefill.queue_bound = v.gpu_decode.queue_bound = gpu_bound
        v.cpu.queue_bound = cpu_bound
        return v
    assert p.route(REQ, now(30, 6, 0, 0)) == "cpu"  # bounds unknown: where it drains sooner
    assert p.route(REQ, now(30, 64, 64, 64)) == "gpu"  # the CPU queue is full: the GPU's is not
    assert p.counters["queue_bound_to_gpu"] == 1
    assert p.route(REQ, now(64, 6, 64, 64)) == "cpu"
    p.counters.clear()
    # the GPU's would drain sooner, but its queue is full
    fast = now(64, 30, 64, 64)
    fast.gpu_decode.tokens_per_s = 5000.0
    assert p.route(REQ, fast) == "cpu" and p.counters["queue_bound_to_cpu"] == 1
    assert p.route(REQ, now(64, 64, 64, 64)) in ("gpu", "cpu")  # both full: a 503 either way
    assert not now(63, 0, 64, 0).gpu_decode.refuses_new() and now(64, 0, 64, 0).gpu_decode.refuses_new()
    assert not now(0, 500, 0, 0).cpu.refuses_new()  # no bound known
