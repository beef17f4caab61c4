"""The harness's arithmetic on fixed inputs: percentiles, TTFT/TPOT/ITL, goodput, token share
and moves from traces, Poisson arrivals, the derived figures, the timeline, the plots."""
import math
import random

import numpy as np
import pytest

from keyacc_ray.bench import side_by_side
from keyacc_ray.bench.loadgen import Result, Workload, pct, poisson_arrivals, summarize
from keyacc_ray.bench.plots import plot_report
from keyacc_ray.bench.timeline import parse_prometheus, reduce_sample, to_series


@pytest.mark.parametrize("p", [0, 10, 50, 90, 99, 100])
def test_pct_matches_numpy(p):
    xs = [random.Random(i).random() * 100 for i in range(37)]
    assert pct(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert math.isnan(pct([], 50))


def res(ttft, tpot, n=5, start=0.0, segments=None, ok=True):
    times = [ttft + i * tpot for i in range(n)]
    return Result(ok=ok, status=200, start_s=start, ttft_s=ttft, e2e_s=times[-1], token_times=times,
                  output_tokens=n if ok else 0, segments=segments or [], wanted=n)


def test_summarize_fixed_inputs():
    seg_move = [{"pool": "gpu", "tokens": 2}, {"pool": "cpu", "tokens": 3}]
    seg_gpu = [{"pool": "gpu", "tokens": 5}]
    results = [res(0.1, 0.02, segments=seg_gpu), res(0.2, 0.05, segments=seg_move),
               res(3.0, 0.02, segments=seg_gpu), res(0.1, 0.2, segments=seg_gpu), res(0.1, 0.1, ok=False)]
    s = summarize(results, wall_s=2.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert s["requests"] == 5 and s["failed"] == 1
    assert s["req_per_s"] == 2.0 and s["output_tok_per_s"] == 10.0  # 4 ok x 5 tokens / 2 s
    # goodput: #1 meets both; #2 (tpot 50 ms) meets both; #3 misses TTFT; #4 misses TPOT
    assert s["goodput_req_per_s"] == 1.0
    assert s["ttft_p50_ms"] == pytest.approx(150.0)  # of 100, 100, 200, 3000
    assert s["tpot_p50_ms"] == pytest.approx(35.0)  # of 20, 20, 50, 200
    assert s["itl_p50_ms"] == pytest.approx(35.0)  # gaps: 8 x 20, 4 x 50, 4 x 200
    assert s["itl_p99_ms"] == pytest.approx(200.0)
    assert s["token_share"] == {"cpu": 0.15, "gpu": 0.85}  # 3 of 20
    assert s["moves"] == 1
    assert "ingress_ttft_p50_ms" not in s  # a server whose trace has no timings
    # the trace's timings: the first hop's start and first token at the server's ingress, p50
    timed = [res(0.1, 0.02, segments=[{"pool": "gpu", "tokens": 5, "start_ms": a, "first_token_ms": b}])
             for a, b in ((2.0, 50.0), (4.0, 70.0), (9.0, 90.0))]
    t = summarize(timed, wall_s=2.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert (t["hop_start_p50_ms"], t["ingress_ttft_p50_ms"]) == (4.0, 70.0)


def test_summarize_steady_state_window():
    # 10 tokens each, one every 0.1 s after a 0.1 s TTFT: request k starts at k s, its tokens
    # arrive at k + 0.1 ... k + 1.0 and it completes at k + 1.0
    results = [res(0.1, 0.1, n=10, start=float(k)) for k in range(6)]
    results[0].ttft_s = 5.0  # the opening burst's slow first token: outside the window
    s = summarize(results, wall_s=99.0, ttft_slo_s=1.0, tpot_slo_s=0.2, window=(2.0, 4.0))
    assert s["output_tok_per_s"] == 10.0  # the 20 tokens arriving in [2, 4) over 2 s
    assert s["requests"] == 2  # started in the window: 2 and 3
    assert s["req_per_s"] == 1.0  # completed in the window: 1 (at 2.0) and 2 (at 3.0)
    assert s["ttft_p99_ms"] == pytest.approx(100.0)
    # a server without token ids: 2 text chunks standing for 10 tokens (usage) count 5 each
    coarse = Result(ok=True, status=200, start_s=2.0, ttft_s=0.5, e2e_s=1.5, token_times=[0.5, 1.5],
                    output_tokens=10, wanted=10)
    assert summarize([coarse], 99.0, 1.0, 1.0, window=(0.0, 1.0))["output_tok_per_s"] == 5.0


def test_workload_lengths_are_seeded_and_spread():
    wl = Workload(prompt_tokens=40, output_tokens=10, prompt_spread=0.5, output_spread=0.2, seed=3)
    a = [wl.sample(random.Random(3)) for _ in range(3)]
    assert a == [wl.sample(random.Random(3)) for _ in range(3)]
    rng = random.Random(9)
    samples = [wl.sample(rng) for _ in range(300)]
    plens = [len(p) for p, _ in samples]
    assert min(plens) >= 20 and max(plens) <= 60 and len(set(plens)) > 10
    assert all(8 <= n <= 12 for _, n in samples)
    fixed = Workload(prompt_tokens=7, output_tokens=3)
    assert all(len(p) == 7 and n == 3 for p, n in (fixed.sample(rng) for _ in range(20)))


def test_poisson_arrivals_rate_and_seed():
    a = poisson_arrivals(20.0, 100.0, seed=1)
    assert a == poisson_arrivals(20.0, 100.0, seed=1) and a != poisson_arrivals(20.0, 100.0, seed=2)
    assert 1800 < len(a) < 2200 and all(0 < x < 100 for x in a) and a == sorted(a)
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.05, rel=0.1)
    assert np.std(gaps) == pytest.approx(0.05, rel=0.15)  # exponential: std == mean


def summary(tps, ttft99=100, tpot99=50, ttft50=50, tpot50=20, failed=0):
    return {"output_tok_per_s": tps, "ttft_p99_ms": ttft99, "tpot_p99_ms": tpot99, "ttft_p50_ms": ttft50,
            "tpot_p50_ms": tpot50, "failed": failed}


def test_cells_in_policy_or_level_order():
    plan = side_by_side.Plan(levels=[2, 8, 24], policies=["a", "b", "c"])
    assert side_by_side.cells(plan) == [(p, c) for p in "abc" for c in (2, 8, 24)]
    level = side_by_side.cells(side_by_side.Plan(levels=[2, 8, 24, 40], policies=["a", "b", "c"], order="level"))
    # every policy at each level before the next; who goes first rotates level by level
    assert level == [("a", 2), ("b", 2), ("c", 2), ("b", 8), ("c", 8), ("a", 8),
                     ("c", 24), ("a", 24), ("b", 24), ("a", 40), ("b", 40), ("c", 40)]
    with pytest.raises(ValueError, match="order"):
        side_by_side.cells(side_by_side.Plan(order="random"))


def test_derived_figures():
    plan = side_by_side.Plan(levels=[2, 8, 16], ttft_slo_ms=1000, tpot_slo_ms=100)
    runs = {
        "gpu_only": {2: summary(50), 8: summary(100, ttft99=1500), 16: summary(90, ttft99=4000)},  # peak 100
        "full_offload": {2: summary(50, ttft50=55), 8: summary(150), 16: summary(190, tpot99=90)},
        "auto": {2: summary(50, tpot50=30), 8: summary(140), 16: summary(180, failed=1)},
    }
    d = side_by_side.derive(runs, summary(100), plan)
    assert d["concurrency_within_slo"] == {"gpu_only": 2, "full_offload": 16, "auto": 8}
    assert d["concurrency_gain"] == {"gpu_only": 1.0, "full_offload": 8.0, "auto": 4.0}
    assert d["throughput_gain"]["full_offload"] == 1.9
    assert d["peak_output_tok_per_s"]["gpu_only"] == 100
    assert d["harvest_efficiency"] == {"gpu_only": 0.0, "full_offload": 0.9, "auto": 0.8}
    assert d["low_load"]["full_offload"] == {"ttft_p50_ratio": 1.1, "tpot_p50_ratio": 1.0}
    assert d["low_load"]["auto"]["tpot_p50_ratio"] == 1.5
    none = side_by_side.derive(runs, None, plan)
    assert none["harvest_efficiency"]["auto"] is None
    assert d["harvest_model"] == {"gpu_only": None, "full_offload": None, "auto": None}  # no CPU accounting here


def test_harvest_model_from_the_stack_cost():
    # stack 0.7 ms/token, gpu_only 180 tok/s, the CPU engine alone 480 tok/s on one core:
    # (1 - 0.0007 * 180) / (1 + 0.0007 * 480) = 0.874 / 1.336
    runs = {8: {"output_tok_per_s": 300.0, "stack_ms_per_token": 1.5},
            40: {"output_tok_per_s": 500.0, "stack_ms_per_token": 0.7}}
    cpu = {"output_tok_per_s": 480.0, "cores_used": {"cpu_decode": 1.0}}
    assert side_by_side.harvest_model(runs, 180.0, cpu) == 0.654
    # a free stack bounds nothing; a stack as dear as the engine halves what the CPU pool adds
    assert side_by_side.harvest_model({40: {"output_tok_per_s": 1, "stack_ms_per_token": 1e-9}}, 180.0, cpu) == 1.0
    assert side_by_side.harvest_model(runs, 0.0, {"output_tok_per_s": 1000 / 0.7, "cores_used": {"cpu_decode": 1.0}}) == 0.5
    assert side_by_side.harvest_model(runs, 180.0, None) is None
    assert side_by_side.harvest_model(runs, 180.0, {"output_tok_per_s": 480.0}) is None


METRICS_A = """# HELP keyacc_queue_depth per replica
keyacc_queue_depth{deployment="GpuDecode",pool="gpu",replica="a",emulated="1"} 3.0
keyacc_queue_depth{deployment="CpuDecode",pool="cpu",replica="b",emulated="0"} 0.0
keyacc_running_sequences{deployment="GpuDecode",pool="gpu",replica="a",emulated="1"} 4.0
keyacc_tokens_generated_total{deployment="GpuDecode",pool="gpu",replica="a",emulated="1"} 100.0
keyacc_tokens_generated_total{deployment="GpuPrefill",pool="gpu",replica="c",emulated="1"} 10.0
keyacc_moves_total{from="gpu",to="cpu",reason="policy"} 2.0
"""
METRICS_B = METRICS_A.replace("} 100.0", "} 160.0").replace('reason="policy"} 2.0', 'reason="policy"} 5.0') + \
    'keyacc_tokens_generated_total{deployment="CpuDecode",pool="cpu",replica="b",emulated="0"} 30.0\n' + \
    'keyacc_moves_total{from="cpu",to="gpu",reason="return"} 1.0\n' + 'keyacc_requests_held 2.0\n'


def test_timeline_from_metrics():
    a, b = reduce_sample(parse_prometheus(METRICS_A)), reduce_sample(parse_prometheus(METRICS_B))
    assert a["queue"] == {"gpu": 3.0, "cpu": 0.0} and a["tokens"] == {"gpu": 110.0}
    s = to_series([(0.0, a), (0.5, b)])
    assert s["t"] == [0.5]
    assert s["tokens_per_s"] == {"gpu": [120.0], "cpu": [60.0]}
    assert s["moves"] == {"gpu->cpu": [3.0], "cpu->gpu": [1.0]}
    assert s["queue"]["gpu"] == [3.0] and s["queue"]["router"] == [2.0]  # held at the router


def test_plots_are_written(tmp_path):
    plan = side_by_side.Plan(levels=[2, 8])
    runs = {p: {2: summary(50), 8: summary(90)} for p in ("gpu_only", "auto")}
    a, b = reduce_sample(parse_prometheus(METRICS_A)), reduce_sample(parse_prometheus(METRICS_B))
    report = {"plan": side_by_side.asdict(plan), "runs": runs, "cpu_alone": summary(40),
              "timeline": {"policy": "auto", "concurrency": 8, **to_series([(0.0, a), (0.5, b), (1.0, b)])}}
    files = plot_report(report, tmp_path)
    assert {f.name for f in files} == {"throughput.png", "tpot_p99.png", "ttft_p99.png", "timeline.png"}
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000


def test_low_load_ratios_use_medians():
    samples = {"gpu_only": [summary(0, ttft50=100, tpot50=10), summary(0, ttft50=300, tpot50=30),
                            summary(0, ttft50=110, tpot50=12)],
               "auto": [summary(0, ttft50=105, tpot50=11), summary(0, ttft50=900, tpot50=90),
                        summary(0, ttft50=100, tpot50=10)]}
    r = side_by_side.low_load_ratios(samples)
    assert r["gpu_only"]["ttft_p50_ratio"] == 1.0
    a = r["auto"]
    assert (a["ttft_p50_ratio"], a["tpot_p50_ratio"]) == (round(105 / 110, 3), round(11 / 12, 3))
    assert (a["ttft_p50_ms"], a["tpot_p50_ms"]) == (105, 11)  # one slow round does not decide
    assert a["rounds_ttft_p50_ms"] == [105, 900, 100] and a["moves"] == 0


def test_low_load_ratios_from_pooled_rounds():
    samples = {"gpu_only": [summary(0, ttft50=100, tpot50=10)], "auto": [summary(0, ttft50=500, tpot50=50)]}
    pooled = {"gpu_only": summary(0, ttft50=200, tpot50=20), "auto": summary(0, ttft50=210, tpot50=19)}
    a = side_by_side.low_load_ratios(samples, pooled)["auto"]
    assert (a["ttft_p50_ratio"], a["tpot_p50_ratio"]) == (1.05, 0.95)
    assert a["rounds_ttft_p50_ms"] == [500]


def test_stack_ms_per_token_counts_everything_but_the_engines():
    from keyacc_ray.bench.cpu_account import stack_ms_per_token

    used = {"cpu_decode": 0.9, "gpu_decode": 0.05, "gpu_prefill": 0.05, "ingress": 0.2, "proxy": 0.1,
            "router": 0.05, "load_generator": 0.05, "ray_other": 0.1}
    assert stack_ms_per_token(used, 500.0) == 1.0  # 0.5 cores for 500 tokens/s
    assert stack_ms_per_token(used, 0.0) is None
    # an engine's thread, accounted within it, is not the stack's
    assert stack_ms_per_token({**used, "cpu_decode/engine": 0.8}, 500.0) == 1.0


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/task"), reason="Linux /proc")
def test_the_engine_threads_cpu_is_told_from_its_processs_other_threads():
    """EngineLoop names its thread in the OS (hw.pinning.name_os_thread); cpu_account counts that
    thread's CPU apart: a named thread's busy work is counted, another thread's is not."""
    import os
    import threading
    import time

    from keyacc_ray.bench.cpu_account import engine_thread_cpu_s
    from keyacc_ray.hw.pinning import ENGINE_THREAD_NAME, name_os_thread

    done, read = threading.Event(), threading.Event()

    def spin(name, seconds, out):
        if name:
            out.append(name_os_thread(name))
        t = time.thread_time()
        while time.thread_time() - t < seconds:
            sum(range(1000))
        if name:  # stays alive until read: an exited thread leaves /proc
            done.set()
            read.wait(30)

    before = engine_thread_cpu_s(os.getpid())
    named = []
    a = threading.Thread(target=spin, args=(ENGINE_THREAD_NAME, 0.3, named))
    b = threading.Thread(target=spin, args=(None, 0.6, []))
    for t in (a, b):
        t.start()
    assert done.wait(30)
    got = engine_thread_cpu_s(os.getpid())
    read.set()
    for t in (a, b):
        t.join()
    assert named == [True]
    assert 0.15 <= got - before <= 0.45  # the named thread's 0.3 s, not the other's 0.6


def test_each_run_draws_prompts_of_its_own():
    """A run replaying another's prompts would find them in the server's prefix cache: runs named
    alike draw the same prompts (reproducible), any two others never do."""
    from keyacc_ray.bench.loadgen import prompt_rng

    wl = Workload(prompt_tokens=16)

    def prompts(stream):
        rng = prompt_rng(wl, stream)
        return [wl.sample(rng)[0] for _ in range(3)]
    assert prompts("auto/8") == prompts("auto/8")
    assert prompts("auto/8") != prompts("auto/40") and prompts("auto/8") != prompts("gpu_only/8")
    assert prompts(None) != prompts(None)  # unnamed: each call a run of its own


def test_requests_report_reads_paths_handoffs_and_waits():
    """scripts/requests_report.py: each run's paths, a move's hand-off wait and first token, the
    client's gap at the move, and each segment's longest waits."""
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("requests_report", ROOT / "scripts" / "requests_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    moved = {"run": "stage_offload/4", "ok": True, "output_tokens": 4, "token_times": [0.05, 0.06, 0.20, 0.21],
             "segments": [{"pool": "gpu", "tokens": 2, "made_gap_ms": 3.0, "loop_lag_ms": 1.0, "ingress_gap_ms": 10.0},
                          {"pool": "cpu", "tokens": 2, "handoff_ms": 30.0, "start_ms": 100.0, "first_token_ms": 190.0,
                           "made_gap_ms": 5.0, "loop_lag_ms": 2.0}]}
    stayed = {"run": "stage_offload/4", "ok": True, "output_tokens": 2, "token_times": [0.05, 0.06],
              "segments": [{"pool": "gpu", "tokens": 2}]}
    rep = mod.report([moved, stayed, dict(stayed)])
    assert rep["requests"] == 3 and rep["paths"] == {"gpu": 0.667, "gpu->cpu": 0.333}
    assert rep["handoff_ms"] == [30.0] * 3 and rep["moved_start_to_first_token_ms"] == [90.0] * 3
    assert rep["client_gap_at_move_ms"] == [140.0] * 3  # from its 2nd token (0.06 s) to its 3rd (0.20 s)
    # the bench's percentiles (loadgen.pct, interpolated): the two segments' 3 and 5 ms
    assert rep["made_gap_ms"] == [4.0, 4.8, 5.0] and rep["loop_lag_ms"] == [1.5, 1.9, 2.0]
    assert rep["ingress_gap_ms"] == [10.0] * 3
    # each segment's own pace: the GPU's 2 tokens 10 ms apart (three times), the CPU's 10 ms
    assert rep["segment_tpot_ms"] == {"cpu": [10.0] * 3, "gpu": [10.0] * 3}
