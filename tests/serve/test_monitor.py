"""LoadState (the load monitor's plain-Python core): aggregation per deployment, stale replicas,
and the version that lets an idle server's routers poll without moving a snapshot each time."""
from __future__ import annotations

from keyacc_ray.serve.monitor import STALE_AFTER_S, LoadState, ReplicaReport


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def report(replica: str, deployment: str = "CpuDecode", waiting: int = 0, running: int = 0,
           free: int = 100, tps: float = 0.0) -> ReplicaReport:
    return ReplicaReport(deployment, "cpu" if deployment == "CpuDecode" else "gpu", "decode", replica,
                         waiting, running, free, 128, 16, 32, tps, 0, False, "cpu")


def test_views_add_up_replicas_of_a_deployment():
    s = LoadState(clock=Clock())
    s.report(report("a", waiting=2, running=5, free=30, tps=10.0))
    s.report(report("b", waiting=1, running=7, free=50, tps=20.0))
    s.report(report("g", deployment="GpuDecode", running=3))
    v = s.snapshot().deployments["CpuDecode"]
    assert (v.replicas, v.num_waiting, v.num_running, v.num_free_blocks, v.max_free_blocks) == (2, 3, 12, 80, 50)
    assert v.tokens_per_s == 30.0 and v.max_num_seqs == 64 and v.free_slots == 64 - 12 - 3
    assert s.snapshot().deployments["GpuDecode"].num_running == 3
    s.report(ReplicaReport(**{**report("a").as_dict(), "max_waiting": 64}))
    s.report(ReplicaReport(**{**report("b").as_dict(), "max_waiting": 32}))
    assert s.snapshot().deployments["CpuDecode"].max_waiting == 96  # the queue bounds add up too


def test_a_deployments_prefill_rate_is_the_mean_of_its_replicas_that_measured_it():
    """A prompt goes through one replica: the view's prefill rate is a replica's (the mean of those
    that measured one), not the sum; none measured: 0 (unknown); the router passes it to the policies."""
    s = LoadState(clock=Clock())
    a, b, c = report("a"), report("b"), report("c")
    a.prefill_tokens_per_s, b.prefill_tokens_per_s = 300.0, 500.0
    for r in (a, b, c, report("g", deployment="GpuDecode")):
        s.report(r)
    views = s.snapshot().deployments
    assert views["CpuDecode"].prefill_tokens_per_s == 400.0 and views["GpuDecode"].prefill_tokens_per_s == 0.0


def test_unchanged_reports_leave_the_version_alone():
    clock = Clock()
    s = LoadState(clock=clock)
    s.report(report("a", running=1))
    snap = s.snapshot()
    assert snap is not None and snap.version == s.version
    clock.t += 1.0
    s.report(report("a", running=1))  # the same content later: a heartbeat, nothing new
    assert s.snapshot(since=snap.version) is None
    s.report(report("a", running=2))
    newer = s.snapshot(since=snap.version)
    assert newer is not None and newer.version > snap.version
    assert newer.deployments["CpuDecode"].num_running == 2


def test_counters_are_news_and_accumulate():
    s = LoadState(clock=Clock())
    v0 = s.snapshot().version
    s.add_counters({})
    assert s.snapshot(since=v0) is None
    s.add_counters({"moves": 2})
    s.add_counters({"moves": 3, "kept": 1})
    snap = s.snapshot(since=v0)
    assert snap is not None and snap.counters == {"moves": 5, "kept": 1}


def test_a_silent_replica_goes_stale_and_that_is_a_change():
    clock = Clock()
    s = LoadState(clock=clock)
    s.report(report("a"))
    s.report(report("b"))
    v = s.snapshot().version
    clock.t += STALE_AFTER_S / 2
    s.report(report("b"))  # b keeps reporting (same content), a has gone quiet
    assert s.snapshot(since=v) is None
    clock.t += STALE_AFTER_S / 2 + 0.1
    snap = s.snapshot(since=v)
    assert snap is not None and snap.deployments["CpuDecode"].replicas == 1
    assert [r["replica"] for r in snap.replicas] == ["b"]


def test_system_figures_refresh_at_most_once_a_second_and_count_as_change():
    clock = Clock()
    probes = []

    def probe():
        probes.append(clock.t)
        return {"available": False}, [{"node": 0, "util_pct": float(len(probes))}]

    s = LoadState(clock=clock, system_probe=probe)
    v = s.snapshot().version
    assert s.snapshot(since=v) is None and len(probes) == 1  # inside the second: no new probe
    clock.t += 1.5
    snap = s.snapshot(since=v)
    assert len(probes) == 2 and snap is not None and snap.cpu_numa[0]["util_pct"] == 2.0


def test_a_restarted_monitor_does_not_answer_none_to_an_old_version():
    old = LoadState(clock=Clock())
    old.report(report("a"))
    held = old.snapshot().version
    fresh = LoadState(clock=Clock())  # the actor restarted: its state is new
    fresh.report(report("a"))
    assert fresh.snapshot(since=held) is not None


def test_gone_ingress_replicas_figures_are_kept_in_the_sum():
    """An ingress replica not heard of for INGRESS_KEEP_S is gone: its request figures move into
    the RETIRED entry, so the sum every ingress replica shows never goes back."""
    from keyacc_ray.serve.metrics import Metrics, RequestTimer
    from keyacc_ray.serve.monitor import INGRESS_KEEP_S, RETIRED

    now = [0.0]
    st = LoadState(clock=lambda: now[0])
    ms = {r: Metrics("m", r) for r in ("ingress-a", "ingress-b")}
    for m, n in ((ms["ingress-a"], 3), (ms["ingress-b"], 2)):
        for _ in range(n):
            t = RequestTimer(m, 1)
            t.tokens(0, 2)
            t.finish(0, {"segments": [{"pool": "gpu", "tokens": 2}]}, "stop", 2)
        st.report_ingress(m.replica, m.local.to_dict())

    def total(snap) -> float:
        return sum(v for _, stats in snap.ingress.values() for n, _, v in stats["counts"]
                   if n == "vllm:request_success")
    assert total(st.snapshot()) == 5
    now[0] = INGRESS_KEEP_S / 2
    st.report_ingress("ingress-b", ms["ingress-b"].local.to_dict())
    now[0] = INGRESS_KEEP_S + 1  # a is gone, b reported lately
    snap = st.snapshot()
    assert set(snap.ingress) == {"ingress-b", RETIRED} and total(snap) == 5
    now[0] = 3 * INGRESS_KEEP_S  # b gone too: both in RETIRED, still 5
    snap = st.snapshot()
    assert set(snap.ingress) == {RETIRED} and total(snap) == 5
    now[0] = 5 * INGRESS_KEEP_S  # RETIRED itself never expires
    assert total(st.snapshot()) == 5


def _with_events(replica: str, events, deployment: str = "CpuDecode") -> ReplicaReport:
    r = report(replica, deployment=deployment)
    r.kv_events = list(events)
    return r


def test_kv_events_are_a_log_a_router_reads_from_its_place():
    """Replicas' KV events go into the monitor's numbered log (not into the replicas' entries of
    the snapshot); a router reads those after its place, once; a place in another log (a monitor
    that restarted) or one the log has moved on past gets everything kept, marked incomplete."""
    import keyacc_ray.serve.monitor as monitor

    s = LoadState(clock=Clock())
    s.report(_with_events("a", [(b"k1", "device"), (b"k2", "device")]))
    first = s.snapshot(kv_after=None)
    assert first.kv_events == [("CpuDecode", "a", b"k1", "device"), ("CpuDecode", "a", b"k2", "device")]
    assert first.kv_complete and all(r["kv_events"] is None for r in first.replicas)
    s.report(report("a"))  # nothing new: no news, the same version
    assert s.snapshot(since=first.version, kv_after=first.kv_log) is None
    s.report(_with_events("g", [(b"k1", "host")], deployment="GpuDecode"))
    s.report(_with_events("a", [(b"k2", "")]))
    nxt = s.snapshot(since=first.version, kv_after=first.kv_log)
    assert nxt.kv_events == [("GpuDecode", "g", b"k1", "host"), ("CpuDecode", "a", b"k2", "")] and nxt.kv_complete
    assert s.snapshot(kv_after=nxt.kv_log).kv_events == []
    other = s.snapshot(kv_after=(nxt.kv_log[0] + 1, nxt.kv_log[1]))  # a restarted monitor's place
    assert len(other.kv_events) == 4 and other.kv_complete  # (the log still holds all of it)
    small = LoadState(clock=Clock())
    small.kv_log = monitor.deque(maxlen=3)
    small.report(_with_events("a", [(bytes([i]), "device") for i in range(5)]))
    late = small.snapshot(kv_after=(small.kv_log_id, 1))
    assert not late.kv_complete and [e[2] for e in late.kv_events] == [bytes([i]) for i in (2, 3, 4)]
    assert small.snapshot(kv_after=(small.kv_log_id, 2)).kv_complete
    assert not small.snapshot(kv_after=None).kv_complete
