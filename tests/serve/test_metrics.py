"""/metrics without Ray: every series a dashboard reads exists from start-up, at zero; the
snapshot's figures per pool and per replica; a request's latencies put on the pools that made
its tokens; the last snapshot kept while the router does not answer; the Grafana dashboard's
queries name only series that are exported."""
import json
import re

from keyacc_ray.histogram import REQUEST_BUCKETS, Histogram
from keyacc_ray.serve.metrics import Metrics, RequestTimer
from keyacc_ray.bench.timeline import parse_prometheus
from tests.conftest import ROOT

VLLM = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
        "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
        "vllm:request_inference_time_seconds_bucket", "vllm:iteration_tokens_total_bucket",
        "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket"]


def samples(text: bytes) -> dict:
    out = {}
    for name, labels, v in parse_prometheus(text.decode()):
        out[(name, tuple(sorted(labels.items())))] = v
    return out


def value(s: dict, name: str, **labels) -> float:
    hits = [v for (n, lab), v in s.items() if n == name and set(labels.items()) <= set(lab)]
    assert hits, (name, labels)
    return sum(hits)


def replica(pool, dep, rid, waiting, running, free, total, qt=None, **kw):
    return {"deployment": dep, "pool": pool, "replica": rid, "emulated": pool == "gpu", "device": pool,
            "num_waiting": waiting, "num_running": running, "num_free_blocks": free, "num_total_blocks": total,
            "tokens_per_s": 10.0, "tokens_generated": 100, "num_preemptions": 2, "prefix_cache_queries": 50,
            "prefix_cache_hits": 20, "histograms": {"vllm:request_queue_time_seconds": qt} if qt else None, **kw}


def snapshot():
    h1, h2 = Histogram(REQUEST_BUCKETS), Histogram(REQUEST_BUCKETS)
    for v in (0.1, 0.4, 3.0):
        h1.observe(v)
    h2.observe(100.0)
    return {"snapshot": {"replicas": [replica("gpu", "GpuDecode", "a", 3, 8, 10, 48, h1.to_dict()),
                                      replica("cpu", "CpuDecode", "b", 1, 4, 30, 40, h2.to_dict()),
                                      replica("cpu", "CpuDecode", "c", 0, 2, 40, 40)],
                         "gpu": {"available": True, "gpus": [{"index": 0, "util_pct": 80.0, "mem_free_bytes": 1e9}]},
                         "cpu_numa": [{"node": 0, "util_pct": 55.0}],
                         "counters": {"moves_total|from=gpu,to=cpu,reason=offload": 7,
                                      "policy_foo_total": 3}},
            "snapshot_age_s": 0.2, "held": 2, "oldest_s": {"held": 0.5, "gpu_decode": 3.25}}


def test_every_series_exists_from_start_up():
    s = samples(Metrics("m").render(None))
    names = {n for n, _ in s}
    assert set(VLLM) <= names
    assert value(s, "keyacc_router_up") == 0
    for pool in ("gpu", "cpu"):
        assert value(s, "vllm:generation_tokens_total", pool=pool) == 0
        assert value(s, "vllm:time_to_first_token_seconds_count", pool=pool) == 0
    assert value(s, "keyacc_moves_total", **{"from": "cpu", "to": "gpu", "reason": "return"}) == 0


def test_snapshot_per_pool_and_replica_and_kept_while_the_router_is_down():
    m = Metrics("m")
    m.count_http("errors_400")
    m.count_http("errors_400")
    s = samples(m.render(snapshot()))
    assert value(s, "keyacc_router_up") == 1
    assert value(s, "vllm:num_requests_waiting", pool="cpu") == 1 and value(s, "vllm:num_requests_running", pool="cpu") == 6
    assert abs(value(s, "vllm:kv_cache_usage_perc", pool="gpu") - 38 / 48) < 1e-9
    assert abs(value(s, "vllm:kv_cache_usage_perc", pool="cpu") - 10 / 80) < 1e-9
    assert value(s, "vllm:request_queue_time_seconds_count", pool="gpu") == 3
    assert value(s, "vllm:request_queue_time_seconds_bucket", pool="gpu", le="0.5") == 2
    assert value(s, "vllm:request_queue_time_seconds_bucket", pool="cpu", le="+Inf") == 1
    assert value(s, "vllm:num_preemptions_total", pool="cpu") == 4
    assert value(s, "keyacc_moves_total", **{"from": "gpu", "reason": "offload"}) == 7
    assert value(s, "keyacc_policy_foo_total") == 3
    assert value(s, "keyacc_queue_depth", deployment="GpuDecode", replica="a") == 3
    assert value(s, "keyacc_http_requests_total", kind="errors_400") == 2
    assert value(s, "keyacc_requests_held") == 2 and value(s, "keyacc_cpu_utilization_percent") == 55
    assert value(s, "keyacc_oldest_request_age_seconds", hop="gpu_decode") == 3.25
    assert value(s, "keyacc_oldest_request_age_seconds", hop="held") == 0.5
    down = samples(m.render(None))  # the router did not answer: the last snapshot, router_up 0
    assert value(down, "keyacc_router_up") == 0
    assert value(down, "vllm:num_requests_running", pool="cpu") == 6


def test_a_request_is_put_on_the_pools_that_made_its_tokens():
    m = Metrics("m")
    t = RequestTimer(m, 1)
    for n in (1, 3, 4, 2):  # 10 tokens in four chunks
        t.tokens(0, n)
    trace = {"segments": [{"pool": "gpu", "tokens": 1}, {"pool": "cpu", "tokens": 7}, {"pool": "gpu", "tokens": 2}]}
    t.finish(0, trace, "length", 10)
    t.prompt(12)
    s = samples(m.render(None))
    assert value(s, "vllm:time_to_first_token_seconds_count", pool="gpu") == 1
    assert value(s, "vllm:time_to_first_token_seconds_count", pool="cpu") == 0
    assert value(s, "vllm:inter_token_latency_seconds_count", pool="cpu") == 7
    assert value(s, "vllm:inter_token_latency_seconds_count", pool="gpu") == 2
    assert value(s, "vllm:generation_tokens_total", pool="cpu") == 7
    assert value(s, "vllm:generation_tokens_total", pool="gpu") == 3
    assert value(s, "vllm:e2e_request_latency_seconds_count", pool="gpu") == 1
    assert value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert value(s, "vllm:prompt_tokens_total") == 12 and value(s, "vllm:request_prompt_tokens_sum") == 12


METRIC = re.compile(r"\b(vllm:[a-zA-Z0-9_:]+|keyacc_[a-zA-Z0-9_]+)")


def dashboard_metrics() -> set[str]:
    dash = json.loads((ROOT / "deployments" / "grafana" / "keyacc.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][0]["query"])
    assert len(exprs) >= 14
    return {m for e in exprs for m in METRIC.findall(e)}


def test_dashboard_queries_name_exported_series():
    names = {n for n, _ in samples(Metrics("m").render(snapshot()))}
    missing = dashboard_metrics() - names
    assert not missing, missing


def test_handoffs_counted_from_the_trace():
    m = Metrics("m")
    t = RequestTimer(m, 1)
    t.tokens(0, 5)
    trace = {"segments": [{"pool": "gpu", "tokens": 1}, {"pool": "cpu", "tokens": 3, "kv_bytes": 4096,
                                                          "handoff_ms": 12.0},
                          {"pool": "gpu", "tokens": 1, "kv_bytes": 8192, "handoff_ms": 3.0}]}
    t.finish(0, trace, "stop", 5)
    s = samples(m.render(None))
    assert value(s, "keyacc_handoffs_total", **{"from": "gpu", "to": "cpu"}) == 1
    assert value(s, "keyacc_handoff_bytes_total", **{"from": "cpu", "to": "gpu"}) == 8192
    assert value(s, "keyacc_handoff_seconds_bucket", **{"from": "gpu", "to": "cpu", "le": "0.01"}) == 0
    assert value(s, "keyacc_handoff_seconds_bucket", **{"from": "gpu", "to": "cpu", "le": "0.025"}) == 1


def test_every_ingress_replicas_requests_whichever_answers():
    """Two ingress replicas: each ships its figures to the monitor (the snapshot's `ingress`);
    either one's /metrics sums both, its own as of now."""
    a, b = Metrics("m", "ingress-a"), Metrics("m", "ingress-b")
    for m, n in ((a, 3), (b, 5)):
        for _ in range(n):
            t = RequestTimer(m, 1)
            t.tokens(0, 4)
            t.finish(0, {"segments": [{"pool": "gpu", "tokens": 4}]}, "stop", 4)
            t.prompt(10)
        m.count_http("completion_requests")
    snap = snapshot()
    snap["snapshot"]["ingress"] = {"ingress-a": (0.0, a.local.to_dict()), "ingress-b": (0.0, b.local.to_dict())}
    for m in (a, b):
        s = samples(m.render(snap))
        assert value(s, "vllm:request_success_total", finished_reason="stop") == 8
        assert value(s, "vllm:e2e_request_latency_seconds_count", pool="gpu") == 8
        assert value(s, "vllm:prompt_tokens_total") == 80
        assert value(s, "keyacc_http_requests_total", kind="completion_requests") == 2
    t = RequestTimer(a, 1)  # a's newest request counts at once in its own scrape (the monitor's copy is older)
    t.tokens(0, 1)
    t.finish(0, {"segments": [{"pool": "cpu", "tokens": 1}]}, "length", 1)
    assert value(samples(a.render(snap)), "vllm:request_success_total", finished_reason="length") == 1
