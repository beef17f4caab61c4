"""The simulator: deterministic for a seed; every request finishes exactly once with its tokens;
the policies deciding are the router's own (the registry's classes, called through the real
Router); the engine model steps as the real engine does (admission, chunked prefill, preemption)."""
import json

import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams, SeqStatus
from keyacc_ray.policies import _REGISTRY, make_policy
from keyacc_ray.serve.router import Router
from keyacc_ray.sim.engine import SimEngine
from keyacc_ray.sim.report import summarize
from keyacc_ray.sim.server import PoolSpec, ServerSpec, SimServer
from keyacc_ray.sim.steptime import StepTime
from keyacc_ray.sim.workload import SimRequest, Workload

GPU = StepTime("gpu", 0.010, 0.00002, 0.0002, 1e-7)
CPU = StepTime("cpu", 0.040, 0.0004, 0.002, 1e-6)
FAST = {"trigger_window_s": 0.05, "return_window_s": 0.3, "decode_period_tokens": 24}


@pytest.fixture(scope="module")
def sim_mod():
    """scripts/simulate.py as a module."""
    import importlib.util

    from tests.conftest import ROOT

    spec_ = importlib.util.spec_from_file_location("simulate", ROOT / "scripts" / "simulate.py")
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    return mod


def spec(**kw):
    return ServerSpec(PoolSpec(GPU, max_num_seqs=8, num_blocks=96), PoolSpec(CPU, max_num_seqs=8, num_blocks=256),
                      kv_bytes_per_token=50_000, **kw)


def run(policy, wl, options=None):
    srv = SimServer(spec(), policy, (FAST if policy != "gpu_only" else {}) if options is None else options)
    done = srv.run(wl.requests())
    return srv, done


@pytest.mark.parametrize("policy", ["gpu_only", "full_offload", "stage_offload", "auto"])
def test_every_request_finishes_once_with_its_tokens(policy):
    wl = Workload(clients=24, requests_per_client=3, prompt_tokens=(32, 200), output_tokens=(8, 120), seed=3)
    srv, done = run(policy, wl)
    reqs = {r.rid: r for r in wl.requests()}
    assert sorted(lv.req.rid for lv in done) == sorted(reqs)  # each exactly once
    for lv in done:
        assert lv.error is None
        assert lv.generated == reqs[lv.req.rid].output_tokens == sum(n for _, n in lv.segments)
        assert lv.req.arrival <= lv.first_t <= lv.done_t
    for e in srv.hops.values():  # nothing left behind: no sequence, every block free
        assert not e.seqs and e.scheduler.num_running == 0 and e.scheduler.num_waiting == 0
        assert e.blocks.num_free_blocks == e.blocks.num_blocks
    assert all(v == 0 for v in srv.router.inflight.values())
    s = summarize(done, srv.hops)
    if policy == "gpu_only":
        assert s["tokens_per_pool"] == {"gpu": s["output_tokens"]}
    else:  # 24 clients on 8 GPU slots: offload happens
        assert s["requests_touching_cpu"] > 0


def test_the_same_seed_gives_the_same_run():
    wl = Workload(kind="poisson", rate=6.0, duration_s=20, seed=11)
    a = summarize(run("auto", wl)[1])
    b = summarize(run("auto", wl)[1])
    assert a == b
    c = summarize(run("auto", Workload(kind="poisson", rate=6.0, duration_s=20, seed=12))[1])
    assert c != a


def test_the_policies_deciding_are_the_routers_own():
    calls = {}
    srv = SimServer(spec(), "auto", FAST)
    assert isinstance(srv.router, Router) and type(srv.router.policy) is _REGISTRY["auto"]
    assert type(srv.router.policy) is type(make_policy("auto"))
    for name in ("route", "after_prefill", "after_period"):
        fn = getattr(srv.router.policy, name)

        def spy(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        setattr(srv.router.policy, name, spy)
    assert srv.router.policy.clock() == srv.now  # the policy runs on simulated time
    srv.run(Workload(clients=24, requests_per_client=2, seed=5).requests())
    assert calls.get("route", 0) >= 48 and calls.get("after_prefill", 0) > 0


def test_engine_model_steps_as_the_real_engine(qwen3_path):
    """Hand-built: 6 requests on an engine with 12 blocks of 4 tokens, 3 slots, a 16-token prompt
    budget, lazy KV: admission, chunked prefill and recompute preemption happen, step by step as
    in LLMEngine (the real scheduler, whose choices the model's bookkeeping feeds)."""
    cfg = dict(max_num_seqs=3, kv_block_size=4, num_kv_blocks=12, max_prefill_tokens=16, kv_allocation="lazy",
               enable_prefix_caching=False)
    real = LLMEngine(EngineConfig(model=qwen3_path, max_model_len=48, **cfg))
    sim = SimEngine("s", "GpuDecode", "gpu", GPU, 3, 12, block_size=4, max_prefill_tokens=16, lazy=True,
                    max_model_len=48)
    jobs = [(10, 12), (7, 20), (20, 6), (5, 15), (13, 9), (3, 25)]
    for i, (p, n) in enumerate(jobs):
        real.add_request(f"q{i}", [5 + (i + k) % 50 for k in range(p)], SamplingParams(max_tokens=n, temperature=0,
                                                                                       ignore_eos=True))
        sim.add(f"q{i}", p, 0, n, with_kv=False)
    steps, preempted = 0, 0
    while real.has_unfinished():
        real.step()
        r = sim.step()
        for s in r.produced if r else []:
            if s.num_output_tokens >= s.params.max_tokens:
                sim.remove(s.request_id, SeqStatus.FINISHED_LENGTH)
        state = lambda e: ([s.request_id for s in e.scheduler.running], [s.request_id for s in e.scheduler.waiting],
                           e.scheduler.num_preemptions, e.blocks.num_free_blocks)
        assert state(real) == state(sim), steps
        preempted = real.scheduler.num_preemptions
        steps += 1
    assert not sim.seqs and preempted > 0 and steps > 20


def test_time_bound_closed_loop_as_the_bench_runs_it():
    """run_closed: each client sends again as soon as its request ends, until send_for_s; every
    request sent finishes; a serving stack that shares the engines' cores slows the steps."""
    from keyacc_ray.sim.workload import SimRequest

    def make(i):
        return SimRequest(f"r{i}", 64, 96, 96)
    srv = SimServer(spec(), "auto", FAST)
    done = srv.run_closed(12, 5.0, make)
    assert done and all(lv.error is None and lv.generated == 96 for lv in done)
    assert max(lv.req.arrival for lv in done) < 5.0 <= max(lv.done_t for lv in done)
    per_client = {}
    for lv in sorted(done, key=lambda lv: lv.req.arrival):
        if lv.req.client in per_client:  # the next one left when the last one ended
            assert abs(lv.req.arrival - per_client[lv.req.client]) < 1e-9
        per_client[lv.req.client] = lv.done_t
    # (gpu_only: one pool, so that no routing decision moves with the step times)
    fast = SimServer(spec(), "gpu_only").run_closed(12, 5.0, make)
    slow = SimServer(spec(stack_s_per_token=0.002, stack_cores=1.0), "gpu_only").run_closed(12, 5.0, make)
    assert summarize(slow)["output_tokens_per_s"] < 0.9 * summarize(fast)["output_tokens_per_s"]
    # a second core that no engine works on takes the stack: nothing lost
    spare = SimServer(spec(stack_s_per_token=0.001, stack_cores=2.0), "gpu_only").run_closed(12, 5.0, make)
    assert summarize(spare)["output_tokens_per_s"] == summarize(fast)["output_tokens_per_s"]


def test_validation_arithmetic(sim_mod):
    """scripts/simulate.py's comparison: MAPE over (policy, level), the largest harvest error,
    the ranking by peak throughput."""
    def run(tok, ttft, tpot):
        return {"output_tok_per_s": tok, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot}
    real = {"runs": {"gpu_only": {"2": run(100, 10, 5), "8": run(200, 20, 10)}, "auto": {"2": run(100, 10, 5),
                                                                                       "8": run(400, 20, 10)}},
            "harvest_efficiency": {"gpu_only": 0.0, "auto": 0.5}, "peak_output_tok_per_s": {"gpu_only": 200, "auto": 400},
            "cpu_alone": {"output_tok_per_s": 400}}
    sim = {"runs": {"gpu_only": {2: run(110, 10, 5), 8: run(200, 30, 10)}, "auto": {2: run(100, 10, 5),
                                                                                 8: run(300, 20, 10)}},
           "harvest_efficiency": {"gpu_only": 0.0, "auto": 0.3}, "peak_output_tok_per_s": {"gpu_only": 200, "auto": 300},
           "cpu_alone": {"output_tok_per_s": 380}}
    got = sim_mod.compare(real, sim)
    assert got["throughput_mape"] == round((0.1 + 0 + 0 + 0.25) / 4, 4)
    assert got["ttft_p50_mape"] == round(0.5 / 4, 4) and got["tpot_p50_mape"] == 0.0
    assert got["harvest_abs_err"] == 0.2 and got["ranking_agrees"] is True
    assert got["tok_s_real_sim"]["auto"]["8"] == [400, 300] and got["tok_s_real_sim"]["cpu_alone"] == [400, 380]
    # the ranking: policies closer than the tolerance are ties; farther ones must keep their order
    real_peaks = {"gpu_only": 200, "full_offload": 600, "auto": 630}
    assert sim_mod.ranking_agrees(real_peaks, {"gpu_only": 210, "full_offload": 650, "auto": 640}, 0.08)
    assert not sim_mod.ranking_agrees(real_peaks, {"gpu_only": 210, "full_offload": 650, "auto": 640}, 0.04)
    assert not sim_mod.ranking_agrees(real_peaks, {"gpu_only": 700, "full_offload": 650, "auto": 640}, 0.08)


def test_a_check_answered_with_another_hop_moves_the_sequence():
    """A request pinned to `stage` (prefill on the GPU, decode on the CPU pool): the pool's check
    after the first token is answered with the CPU hop, and the sequence leaves the GPU engine and
    decodes on the CPU engine (the router answers with the same Ticket, its hop changed in place:
    compared with itself, every such answer looked like "stay", and the GPU kept decoding what
    the router counted on the CPU)."""
    from keyacc_ray.sim.workload import SimRequest

    srv = SimServer(spec(), "gpu_only")
    done = srv.run([SimRequest(f"s{i}", 40, 30, 30, route="stage") for i in range(4)])
    assert all([p for p, _ in lv.segments] == ["gpu", "cpu"] and lv.segments[0][1] == 1 for lv in done)
    assert srv.hops["gpu_decode"].tokens_generated == 4 and srv.hops["cpu_decode/0"].tokens_generated == 4 * 29


def test_planning_scenarios_and_search():
    """The planning scenarios build (KV from the memory left after the weights, the CPU pool's
    slots and prompt chunk from the TPOT objective), the roofline step takes the longer of bytes
    and FLOPs, and the search finds the most clients within the objective on a hand-checked case."""
    from keyacc_ray.sim.hardware import SCENARIOS
    from keyacc_ray.sim.plan import max_clients, meets
    from keyacc_ray.sim.steptime import roofline

    st = roofline("x", 2e9, 1e9, 1e12, 1e14, 1000, 0.5, 0.5)  # 4 ms to read the weights, 40 us a token
    assert st.seconds(0, 1, 0) == pytest.approx(0.004)  # bandwidth-bound
    assert st.seconds(1000, 0, 0) == pytest.approx(0.04)  # compute-bound
    assert st.seconds(0, 1, 2_000_000) == pytest.approx(0.008)  # + 4 ms of KV
    for sc in SCENARIOS.values():
        sp, d = sc.spec(), sc.describe()
        assert sp.gpu.num_blocks * 16 * sc.model.kv_bytes_per_token() + sc.model.weight_bytes(
            sc.gpu.weight_bytes_per_param) <= sc.gpu.device.mem_bytes
        rows = sc.cpu_slots()
        if rows:
            ctx = sc.workload.mean_context
            assert sp.cpu.steptime.seconds(0, rows, int(rows * ctx)) <= 0.8 * sc.tpot_slo_s
            assert sp.cpu.steptime.seconds(sp.cpu.max_prefill_tokens, rows, int(rows * ctx)) <= sc.tpot_slo_s
            assert rows == sc.cpu.max_num_seqs or sp.cpu.steptime.seconds(
                0, rows + 1, int((rows + 1) * ctx)) > 0.8 * sc.tpot_slo_s
        assert d["cpu_bw_gb_s_total"] > 0
    # one GPU engine of 8 slots, steps of 10 ms + 0.2 ms a row, 20-token requests: a client's
    # request takes about 0.2 s; beyond 8 clients they queue, TTFT grows by a request per 8
    one = ServerSpec(PoolSpec(StepTime("g", 0.01, 0.0, 0.0002, 0.0), max_num_seqs=8, num_blocks=1000),
                     PoolSpec(CPU, max_num_seqs=8, num_blocks=256))

    class W:
        prompt_tokens, output_tokens, max_tokens = (16, 16), (20, 20), 20
    c, s, tried = max_clients(one, "gpu_only", W, ttft_slo_s=0.3, tpot_slo_s=1.0, ramp_s=2.0, measure_s=6.0)
    assert meets(s, 0.3, 1.0) and 8 <= c < 32
    assert not meets(dict(tried)[max(k for k, _ in tried if k > c)], 0.3, 1.0)


def test_the_h200_host_entries_reproduce_its_steps():
    """The planning figures of the lent H200 host are our engine's measurements there
    (keyacc_ray/sim/measured/h200-host.json): the GPU's roofline gives the 14B shape's decode steps
    at 1, 16 and 64 sequences within 8%, the CPU's the 0.4B shape's batch-1 step and its 512-token
    prefill within 10%."""
    import json
    from pathlib import Path

    from keyacc_ray.sim import hardware as hw

    got = json.loads((Path(hw.__file__).with_name("measured") / "h200-host.json").read_text())
    gpu = hw.SCENARIOS["h200-host"].steptime(hw.SCENARIOS["h200-host"].gpu)
    for p in got["gpu_decode"]["points"]:
        t = gpu.seconds(0, p["batch"], int(p["batch"] * p["mean_context"]))
        assert abs(t * 1e3 / p["step_ms"] - 1) <= 0.08, (p, t)
    c = got["cpu"]
    small = hw.Model("bench", c["params"], 24, 8, 128)
    d = hw.H200_HOST_CPU
    assert d.bw_bytes_s == c["read_bw_gbs"] * 1e9
    st = hw.roofline("cpu", small.weight_bytes(2.0), small.params, d.bw_bytes_s, d.flops, small.kv_bytes_per_token(),
                     d.bw_eff, d.flop_eff, d.step_fixed_s)
    assert abs(st.seconds(0, 1, 128) * c["decode_bs1_tokens_per_s_avx512"] - 1) <= 0.10
    assert abs(st.seconds(512, 0, 0) / (512 / c["prefill_512_tokens_per_s_amx"]) - 1) <= 0.10


def test_the_growth_reserve_runs_in_the_simulated_pools_too():
    """PoolSpec.growth_reserve is the real scheduler's (EngineConfig.kv_growth_reserve): every
    request still finishes once, and the GPU pool, far below the working set, preempts less."""
    wl = Workload(clients=24, requests_per_client=3, prompt_tokens=(32, 200), output_tokens=(8, 120), seed=3)
    preempted = {}
    for reserve in (False, True):
        s = ServerSpec(PoolSpec(GPU, max_num_seqs=8, num_blocks=48, growth_reserve=reserve),
                       PoolSpec(CPU, max_num_seqs=8, num_blocks=256), kv_bytes_per_token=50_000)
        srv = SimServer(s, "gpu_only", {})
        done = srv.run(wl.requests())
        assert sorted(lv.req.rid for lv in done) == sorted(r.rid for r in wl.requests())
        gpu = srv.hops["gpu_decode"].scheduler
        assert (gpu.growth is not None) == reserve
        preempted[reserve] = gpu.num_preemptions
    assert preempted[True] < preempted[False], preempted


def test_the_stack_fit_reads_what_the_engine_threads_did_not_get(sim_mod):
    """scripts/simulate.py's fit_stack: with the engine threads accounted apart, the stack's claim
    is every core the two replicas did not get (fixed + per token over the runs where both worked)
    and each replica's own other threads are its pool's `own_cores`; an older report falls back to
    the stack's processes' CPU."""
    def run(tok, gpu, cpu, gpu_t, cpu_t, stack=0.3, moves=0):
        return {"output_tok_per_s": tok, "cores_used": {"gpu_decode": gpu, "cpu_decode": cpu, "ingress": stack},
                "engine_thread_cores": {"gpu_decode": gpu_t, "cpu_decode": cpu_t}, "requests": 100,
                "req_per_s": 5.0, "moves": moves}
    # the replicas get 2 - (0.4 + 0.001 x tokens/s) between them; each loses 0.05 to its own
    # threads, and the CPU replica 4 ms more for each request moved (20 s: 0, 2 and 5 moves a second)
    runs = {"auto": {str(t): run(t, (1.6 - t / 1000) / 2, (1.6 - t / 1000) / 2, (1.6 - t / 1000) / 2 - 0.05,
                                 (1.6 - t / 1000) / 2 - 0.05 - 0.004 * m / 20, moves=m)
                     for t, m in ((200, 0), (400, 40), (600, 100))},
            "gpu_only": {"8": run(250, 0.97, 0.01, 0.92, 0.0)}}
    real = {"box": {"cpus": 2}, "runs": runs, "cpu_alone": run(700, 0.0, 0.99, 0.0, 0.94)}
    got = sim_mod.fit_stack(real)
    assert got["runs"] == 3 and got["fixed_cores"] == pytest.approx(0.4) and got["s_per_token"] == pytest.approx(1e-3)
    assert got["pool_own_cores"] == {"gpu": pytest.approx(0.05), "cpu": pytest.approx(0.05)}
    assert got["pool_own_s_per_move"] == {"gpu": 0.0, "cpu": pytest.approx(0.004)}
    for lv in runs.values():
        for r in lv.values():
            del r["engine_thread_cores"]
    del real["cpu_alone"]["engine_thread_cores"]
    old = sim_mod.fit_stack(real)
    assert old["fixed_cores"] == pytest.approx(0.3) and old["s_per_token"] == 0.0 and old["pool_own_cores"] is None


def test_the_fits_lines_keep_both_terms_at_or_above_zero(sim_mod):
    assert sim_mod._line([1, 2, 3], [1.5, 2.5, 3.5]) == pytest.approx((0.5, 1.0))
    assert sim_mod._line([1, 2, 3], [3, 2, 1]) == pytest.approx((2.0, 0.0))  # falling: flat at the mean
    # steep: y = -1 + 2x would cross zero; through the origin instead, y = b x by least squares
    a, b = sim_mod._line([1, 2, 3], [1, 3, 5])
    assert a == 0.0 and b == pytest.approx(22 / 14)


def test_a_replicas_own_threads_lengthen_its_engines_steps():
    st = StepTime("s", 0.01, 0.0, 0.0, 0.0)
    plain = SimEngine("a", "GpuDecode", "gpu", st, 4, 64)
    shared = SimEngine("b", "GpuDecode", "gpu", st, 4, 64, own_cores=0.2)
    for e in (plain, shared):
        assert e.add("r", 8, 0, 4, with_kv=False)
    assert shared.step().seconds == pytest.approx(plain.step().seconds / 0.8)
    # the stack's share and the moves' add to it, in cores (the real run's accounting), not as factors
    shared.stack_share, shared.move_cores = 0.3, 0.1
    assert shared.step().seconds == pytest.approx(plain.step().seconds / 0.4)


def test_requests_moving_between_the_pools_take_from_the_replicas_cores():
    """PoolSpec.own_s_per_move: a CPU replica's own threads' CPU for each request moved, at the
    rate of the last MOVE_WINDOW_S, lengthens its engine's steps: stage_offload's decodes (every
    one moved) run slower with it, gpu_only's (none moved) not at all."""
    from keyacc_ray.sim.server import MOVE_WINDOW_S

    def served(policy, per_move):
        sp = ServerSpec(PoolSpec(GPU, max_num_seqs=4, num_blocks=96),
                        PoolSpec(CPU, max_num_seqs=16, num_blocks=512, own_s_per_move=per_move))
        srv = SimServer(sp, policy, {"trigger_window_s": 0.05, "return_window_s": 0.3} if policy != "gpu_only" else {})
        done = srv.run_closed(12, 6.0, lambda i: SimRequest(f"r{i}", 48, 64, 64))
        return srv, sum(lv.done_t - lv.req.arrival for lv in done) / len(done)  # (mean end to end)
    srv, plain = served("stage_offload", 0.0)
    assert sum(lv.moves for lv in srv.done) > 2 * MOVE_WINDOW_S  # (it moved requests)
    _, charged = served("stage_offload", 0.02)
    assert charged > 1.02 * plain
    assert served("gpu_only", 0.02)[1] == served("gpu_only", 0.0)[1]


def test_the_corun_factor_lengthens_a_pools_steps_only_while_the_other_pool_works():
    """PoolSpec.corun_factor: a CPU step beside a working GPU engine takes that many times the
    profile's time; with the GPU pool idle (every request pinned to the CPU pool) not at all."""
    def served(policy, factor, route=None):
        sp = ServerSpec(PoolSpec(GPU, max_num_seqs=4, num_blocks=96),
                        PoolSpec(CPU, max_num_seqs=16, num_blocks=512, corun_factor=factor))
        srv = SimServer(sp, policy, {"trigger_window_s": 0.05, "return_window_s": 0.3} if policy != "gpu_only" else {})
        srv.run_closed(12, 6.0, lambda i: SimRequest(f"r{i}", 48, 64, 64, route=route))
        cpu = srv.hops["cpu_decode/0"]
        return cpu.busy_s / cpu.tokens_generated, srv  # (the CPU engine's seconds a token)
    (plain, srv), (slower, _) = served("full_offload", 1.0), served("full_offload", 1.2)
    assert srv.hops["cpu_decode/0"].tokens_generated > 0 and srv.hops["gpu_decode"].tokens_generated > 0
    assert 1.1 * plain < slower <= 1.2 * plain + 1e-9  # (its steps beside the GPU's, most of them)
    assert served("gpu_only", 1.2, route="cpu")[0] == served("gpu_only", 1.0, route="cpu")[0]  # the CPU pool alone


def test_the_corun_factor_is_read_from_a_step_trace_kind_by_kind():
    """keyacc_ray/sim/corun.py: steps whose midpoint lies in the other engine's busy spans against
    steps alone, compared at the same decode rows (so the profile's error by rows cancels)."""
    from keyacc_ray.sim.corun import busy_spans, corun_factor

    flat = StepTime("flat", 0.010, 0.0, 0.0, 0.0)  # 10 ms a step, whatever the rows
    other = [{"t": 10.0 + 0.01 * k, "wall_s": 0.01} for k in range(500)]  # busy over [10, 15]
    assert busy_spans(other) == [(pytest.approx(9.99), pytest.approx(14.99))]

    def step(t, rows, cpu):
        return {"t": t, "wall_s": 0.01, "cpu_s": cpu, "rows": rows, "prompt_tokens": 0, "kv_tokens": 0,
                "attn_pairs": 0}
    # alone (before 10 s and after 15 s): 4 rows at 12 ms, 16 rows at 20 ms (the profile's error);
    # beside the other engine the same rows at 1.1x that
    mine = [step(1 + 0.01 * k, 4 if k % 2 else 16, 0.012 if k % 2 else 0.020) for k in range(400)]
    mine += [step(10.5 + 0.01 * k, 4 if k % 4 else 16, 0.0132 if k % 4 else 0.022) for k in range(400)]
    mine += [step(20 + 0.01 * k, 16, 0.020) for k in range(50)]
    got = corun_factor(mine, other, flat)
    assert got["factor"] == pytest.approx(1.1) and got["beside"] == 400 and got["alone"] == 450
    # a kind seen alone only a few times (a cell's drain) is no sample of it: left out
    sparse = mine + [step(30 + 0.01 * k, 8, 0.030) for k in range(20)] + [step(12 + 0.001 * k, 8, 0.010)
                                                                        for k in range(100)]
    assert corun_factor(sparse, other, flat)["factor"] == pytest.approx(1.1)
    assert corun_factor(sparse, other, flat, min_steps=10)["factor"] < 1.0
    # a row count seen only one way is left out; none seen both ways: no factor
    assert corun_factor(mine[400:800], other, flat)["factor"] is None


def test_the_stacks_request_path_adds_to_each_request_and_spaces_a_clients_requests():
    """ServerSpec.request_path_s: half before the router sees a request, half on each token's way
    back; a closed-loop client's next request starts when its last token is in."""
    def one_client(path):
        sp = ServerSpec(PoolSpec(GPU, max_num_seqs=8, num_blocks=96), PoolSpec(CPU, max_num_seqs=8, num_blocks=256),
                        request_path_s=path)
        return SimServer(sp, "gpu_only", {}).run_closed(1, 1.0, lambda i: SimRequest(f"r{i}", 32, 16, 16))
    fast, slow = one_client(0.0), one_client(0.02)
    ttft = lambda lv: lv.first_t - lv.req.arrival  # noqa: E731
    assert ttft(slow[0]) == pytest.approx(ttft(fast[0]) + 0.02)
    assert slow[0].done_t - slow[0].req.arrival == pytest.approx(fast[0].done_t - fast[0].req.arrival + 0.02)
    assert slow[1].req.arrival == pytest.approx(slow[0].done_t)  # the next request when the last token is in
    assert len(slow) < len(fast)  # fewer requests in the same second
    # the trace's timings at the ingress, half the path in: the hop taken at once, its token made there
    assert slow[0].first_hop_t == pytest.approx(slow[0].req.arrival + 0.01)
    assert slow[0].first_made_t == pytest.approx(slow[0].first_t - 0.01)


def test_step_jitter_draws_steps_apart_around_the_model_for_a_seed():
    """ServerSpec.step_jitter: each step's time drawn about the model's (mean 1), from the seed's
    source: the same seed, the same run; another seed, another run; no jitter, the model's times."""
    def make(i):
        return SimRequest(f"r{i}", 48, 40, 40)

    def tokens_per_s(**kw):
        srv = SimServer(spec(**kw), "gpu_only")
        done = srv.run_closed(6, 30.0, make)
        return summarize(done)["output_tokens_per_s"], [lv.token_times for lv in done[:4]]
    plain = tokens_per_s()
    assert tokens_per_s(step_jitter=0.0, seed=5) == plain
    a, b = tokens_per_s(step_jitter=0.3, seed=1), tokens_per_s(step_jitter=0.3, seed=1)
    c = tokens_per_s(step_jitter=0.3, seed=2)
    assert a == b and a[1] != c[1] and a[1] != plain[1]
    # the steps' mean stays the model's: the rate within a few percent over ~1,000 steps
    assert a[0] == pytest.approx(plain[0], rel=0.05) and c[0] == pytest.approx(plain[0], rel=0.05)


def test_a_cells_figures_are_the_mean_over_seeds(sim_mod):
    """scripts/simulate.py: one (policy, level) is the mean of its figures over seeds (numbers, and
    numbers within a dict); one seed is that run's own summary; with nothing drawn (no jitter, equal
    lengths) one run stands for all."""
    a = {"ttft_p50_ms": 100.0, "requests": 10, "token_share": {"gpu": 1.0}, "errors": []}
    b = {"ttft_p50_ms": 140.0, "requests": 13, "token_share": {"gpu": 0.5, "cpu": 0.5}, "errors": ["x"]}
    assert sim_mod.mean_summary([a]) is a
    m = sim_mod.mean_summary([a, b])
    assert m == {"ttft_p50_ms": 120.0, "requests": 11.5, "token_share": {"cpu": 0.25, "gpu": 0.75}, "errors": []}
    plan = sim_mod.Plan(levels=[4], duration_s=4.0, ramp_s=1.0, policies=["gpu_only"])
    wl = {"prompt_tokens": 48, "output_tokens": 40, "prompt_spread": 0.0, "output_spread": 0.0}
    one = sim_mod.one_run(spec(), "gpu_only", {}, 4, plan, wl)
    assert sim_mod.one_run(spec(), "gpu_only", {}, 4, plan, wl, seeds=5) == one
    runs = [sim_mod.one_run(spec(step_jitter=0.3, seed=k), "gpu_only", {}, 4, plan, wl) for k in range(3)]
    three = sim_mod.one_run(spec(step_jitter=0.3), "gpu_only", {}, 4, plan, wl, seeds=3)
    assert three["ttft_p50_ms"] == pytest.approx(sum(r["ttft_p50_ms"] for r in runs) / 3, abs=1e-3)
    spread = dict(wl, output_spread=0.5)  # lengths drawn per seed: runs differ without jitter
    assert (sim_mod.one_run(spec(), "gpu_only", {}, 4, plan, spread, seeds=3)
            != sim_mod.one_run(spec(), "gpu_only", {}, 4, plan, spread))


def test_the_step_jitter_fit_reads_the_quietest_cells_tpot_spread(sim_mod):
    """fit_step_jitter: gpu_only at its lowest level; a request's TPOT is the mean of its steps, so
    the step's spread is the TPOT's (p50-p90 over 1.28) times sqrt(steps); capped at 0.5."""
    real = {"workload": {"output_tokens": 101},
            "runs": {"gpu_only": {"8": {"tpot_p50_ms": 20.0, "tpot_p90_ms": 30.0},
                                  "2": {"tpot_p50_ms": 10.0, "tpot_p90_ms": 10.2563}}}}
    assert sim_mod.fit_step_jitter(real) == pytest.approx(0.2, abs=1e-3)
    real["runs"]["gpu_only"]["2"]["tpot_p90_ms"] = 20.0
    assert sim_mod.fit_step_jitter(real) == 0.5
    assert sim_mod.fit_step_jitter({"runs": {"auto": {}}}) is None
    # what the model spreads by itself comes out in quadrature: 0.04 real, 0.024 modelled -> 0.032
    real["runs"]["gpu_only"]["2"]["tpot_p90_ms"] = 10 + 0.4 * 1.2816
    modelled = {"tpot_p50_ms": 10.0, "tpot_p90_ms": 10 + 0.24 * 1.2816}
    assert sim_mod.fit_step_jitter(real, modelled) == pytest.approx(0.32, abs=1e-3)
    assert sim_mod.fit_step_jitter(real, {"tpot_p50_ms": 10.0, "tpot_p90_ms": 11.0}) == 0.0


def test_the_hop_start_fit_reads_how_much_longer_a_busy_replica_takes_a_new_request(sim_mod):
    """fit_hop_start: the median hop start above the lowest level less the median at it, in ms;
    never below 0; None without the trace's figures."""
    real = {"runs": {"auto": {"2": {"hop_start_p50_ms": 6.0}, "8": {"hop_start_p50_ms": 12.0},
                              "24": {"hop_start_p50_ms": 14.0}},
                     "gpu_only": {"2": {"hop_start_p50_ms": 5.0}, "8": {"hop_start_p50_ms": 13.0},
                                  "24": {"hop_start_p50_ms": 30.0}}}}
    assert sim_mod.fit_hop_start(real) == pytest.approx(13.5 - 5.5)
    real["runs"]["auto"]["8"]["hop_start_p50_ms"] = real["runs"]["gpu_only"]["8"]["hop_start_p50_ms"] = 1.0
    real["runs"]["auto"]["24"]["hop_start_p50_ms"] = real["runs"]["gpu_only"]["24"]["hop_start_p50_ms"] = 2.0
    assert sim_mod.fit_hop_start(real) == 0.0
    assert sim_mod.fit_hop_start({"runs": {"auto": {"2": {"tpot_p50_ms": 9.0}}}}) is None


def test_a_busy_replica_takes_a_new_request_later_and_a_moved_one_as_before():
    """ServerSpec.hop_start_busy_s: a request's first hop waits that much longer when its replica's
    engine is working, nothing when it is idle; hand-offs keep their own cost."""
    def served(extra, clients):
        sp = ServerSpec(PoolSpec(GPU, max_num_seqs=8, num_blocks=96), PoolSpec(CPU, max_num_seqs=8, num_blocks=256),
                        hop_start_busy_s=extra)
        return SimServer(sp, "gpu_only", {}).run_closed(clients, 1.0, lambda i: SimRequest(f"r{i}", 32, 16, 16))
    start = lambda lv: lv.first_hop_t - lv.req.arrival  # noqa: E731
    alone, alone_later = served(0.0, 1), served(0.05, 1)
    assert start(alone_later[0]) == pytest.approx(start(alone[0]))  # an idle replica: at once
    busy, busy_later = served(0.0, 4), served(0.05, 4)
    waits = sorted(start(lv) for lv in busy_later[:4])
    assert waits[0] == pytest.approx(start(busy[0])) and waits[-1] >= 0.05  # the first at once, the next later


def test_a_comparison_reads_the_gpu_pools_profile_fitted_beside_the_run(sim_mod, tmp_path):
    """--validate fits a profile on each pool's core; comparing a run again finds the GPU pool's
    beside its report, and a run without one keeps the one profile for both pools."""
    report = tmp_path / "report.json"
    report.write_text("{}")
    assert sim_mod.gpu_profile_beside(str(report)) is None
    (tmp_path / sim_mod.GPU_PROFILE).write_text(json.dumps(StepTime("core0", 0.02, 0.0, 0.0, 0.0).to_dict()))
    got = sim_mod.gpu_profile_beside(str(report))
    assert got.seconds(0, 4, 0) == pytest.approx(0.02)


def test_a_comparison_fits_each_pools_corun_factor_from_the_trace_beside_the_run(sim_mod, tmp_path):
    """--validate traces the real run's steps (`steps/` beside its report, each record naming its
    pool); the comparison fits each pool's corun_factor from them. No trace, or records without
    their pool (older traces): none."""
    flat = StepTime("flat", 0.010, 0.0, 0.0, 0.0)
    trace = tmp_path / sim_mod.TRACE_DIR
    assert sim_mod.fit_corun(trace, flat, flat) == {}

    def step(t, cpu, pool):
        return json.dumps({"t": t, "wall_s": 0.01, "cpu_s": cpu, "rows": 8, "prompt_tokens": 0, "kv_tokens": 0,
                           "attn_pairs": 0, "pool": pool})
    # the GPU engine alone over [0, 5] and beside the CPU engine over [5, 10] (1.2x); the CPU engine
    # only beside it, so nothing to compare it with
    gpu = [step(0.01 * k, 0.010 if k < 500 else 0.012, "gpu") for k in range(1, 1000)]
    cpu = [step(5.0 + 0.01 * k, 0.010, "cpu") for k in range(1, 500)]
    trace.mkdir()
    (trace / "steps-1.jsonl").write_text("\n".join(gpu) + "\n")
    (trace / "steps-2.jsonl").write_text("\n".join(cpu) + "\n")
    assert sim_mod.fit_corun(trace, flat, flat) == {"gpu": pytest.approx(1.2, abs=0.01)}
    (trace / "steps-2.jsonl").write_text("\n".join(c.replace(', "pool": "cpu"', "") for c in cpu) + "\n")
    assert sim_mod.fit_corun(trace, flat, flat) == {}
