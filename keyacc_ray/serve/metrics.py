"""GET /metrics through prometheus_client: vLLM's metric names for what vLLM measures, with `pool`
(and per replica `deployment`, `replica`, `device`) labels, beside the keyacc-specific series.

Two sources, one registry per ingress replica:
- what the ingress replicas measure themselves, per request (`RequestTimer` into `RequestStats`):
  time to first token, inter-token latency and end-to-end latency (each token's gap is put on the
  pool that made the token, by the request's trace), prompt and generation tokens, finished
  requests by reason, KV hand-offs, HTTP requests; each replica ships its cumulative figures to
  the load monitor every INGRESS_REPORT_S when they changed (every INGRESS_HEARTBEAT_S when not),
  so whichever replica answers a scrape sums them all (its own as of now);
- the router's load snapshot (`SnapshotCollector`, the monitor's per-replica reports and the
  router's counters): running and waiting requests, KV cache use, preemptions, prefix cache,
  queue time (each engine's own histogram), moves by direction and reason, and the rest.
Every series a dashboard reads exists from start-up, at zero until something happens. The
snapshot is the last one the router gave: while the router does not answer, /metrics still
answers, with `keyacc_router_up 0` and that snapshot's figures (and its age).
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("PROMETHEUS_DISABLE_CREATED_SERIES", "True")  # no *_created series (as vLLM)

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.core import (  # noqa: E402
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from keyacc_ray.histogram import (  # noqa: E402
    ENGINE_HISTOGRAMS,
    ITL_BUCKETS,
    N_BUCKETS,
    REQUEST_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
)
from keyacc_ray.histogram import merge as merge_hist  # noqa: E402
from keyacc_ray.histogram import sum_stats  # noqa: E402

POOLS = ("gpu", "cpu")
HANDOFF_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REASONS = ("stop", "length", "abort", "tool_calls")
# the router's counters a dashboard reads, with every label set they take: present at zero from start-up
KNOWN_COUNTERS = {
    "moves_total": [{"from": "gpu", "to": "cpu", "reason": r} for r in ("offload", "pinned", "backpressure", "stalled")]
                   + [{"from": "cpu", "to": "gpu", "reason": r} for r in ("return", "pinned", "recall", "stalled")],
    "requests_started_total": [{"route": r, "reason": w} for r in ("gpu", "cpu", "stage") for w in ("policy", "pinned")],
    "pool_seconds_total": [{"pool": p} for p in POOLS],
    "requests_held_total": [{}],
    "stalls_waited_total": [{"hop": h} for h in ("gpu_decode", "cpu_decode")],
    "recoveries_total": [],
    "rejected_total": [],
}
REPLICA_GAUGES = {  # report field -> keyacc name (kept for the bench's timeline and older dashboards)
    "num_waiting": "keyacc_queue_depth", "num_running": "keyacc_running_sequences",
    "num_free_blocks": "keyacc_free_kv_blocks", "num_total_blocks": "keyacc_total_kv_blocks",
    "tokens_per_s": "keyacc_tokens_per_second",
}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
INGRESS_REPORT_S = 1.0
INGRESS_HEARTBEAT_S = 20.0  # unchanged figures are sent again this seldom (the monitor keeps them 60 s)


# What each ingress replica measures itself: name -> (label names, buckets or None for a counter, help).
# Plain cumulative figures (RequestStats), shipped to the load monitor, so that whichever ingress
# replica answers a scrape shows every replica's requests.
REQUEST_SERIES = {
    "vllm:time_to_first_token_seconds": (("model_name", "pool"), TTFT_BUCKETS, "Time to first token, by the pool "
                                         "that made it"),
    "vllm:inter_token_latency_seconds": (("model_name", "pool"), ITL_BUCKETS, "Gap before each output token, by the "
                                         "pool that made the token"),
    "vllm:e2e_request_latency_seconds": (("model_name", "pool"), REQUEST_BUCKETS, "Request latency, by the pool it "
                                         "finished on"),
    "vllm:request_prompt_tokens": (("model_name",), TOKEN_BUCKETS, "Prompt tokens per request"),
    "vllm:request_generation_tokens": (("model_name",), TOKEN_BUCKETS, "Output tokens per choice"),
    "vllm:request_params_n": (("model_name",), N_BUCKETS, "Choices asked for per prompt (n)"),
    "vllm:request_params_max_tokens": (("model_name",), TOKEN_BUCKETS, "max_tokens per request"),
    "keyacc_handoff_seconds": (("from", "to"), HANDOFF_BUCKETS, "From the end of a hop to the start of the next one "
                               "with its KV (export, object store, import)"),
    "vllm:prompt_tokens": (("model_name",), None, "Prompt tokens of finished requests"),
    "vllm:generation_tokens": (("model_name", "pool"), None, "Output tokens streamed, by the pool that made them"),
    "vllm:request_success": (("model_name", "finished_reason"), None, "Finished requests (choices), by finish reason"),
    "keyacc_handoffs": (("from", "to"), None, "KV hand-offs between pools (the KV went along)"),
    "keyacc_handoff_bytes": (("from", "to"), None, "KV bytes handed off between pools"),
    "keyacc_http_requests": (("kind",), None, "HTTP requests and errors at the ingress"),
}


class RequestStats:
    """Cumulative counters and histograms by (series, label values); `to_dict` / `merge` carry
    them between processes."""

    def __init__(self):
        self.counts: dict[tuple, float] = {}
        self.hists: dict[tuple, Histogram] = {}

    def inc(self, name: str, labels: tuple, n: float = 1.0) -> None:
        key = (name, labels)
        self.counts[key] = self.counts.get(key, 0.0) + n

    def observe(self, name: str, labels: tuple, v: float) -> None:
        h = self.hists.get((name, labels))
        if h is None:
            h = self.hists[(name, labels)] = Histogram(REQUEST_SERIES[name][1])
        h.observe(v)

    def touch(self, name: str, labels: tuple) -> None:
        """The series exists (at zero) from now on."""
        if REQUEST_SERIES[name][1] is None:
            self.counts.setdefault((name, labels), 0.0)
        elif (name, labels) not in self.hists:
            self.hists[(name, labels)] = Histogram(REQUEST_SERIES[name][1])

    def to_dict(self) -> dict:
        return {"counts": [[n, list(lab), v] for (n, lab), v in self.counts.items()],
                "hists": [[n, list(lab), h.to_dict()] for (n, lab), h in self.hists.items()]}

    @staticmethod
    def merged(dicts: list[dict]) -> tuple[dict, dict]:
        """(counts, hists) summed over several replicas' to_dict()s, keyed by (name, labels)."""
        total = sum_stats(dicts)
        return ({(n, tuple(lab)): v for n, lab, v in total["counts"]},
                {(n, tuple(lab)): h for n, lab, h in total["hists"]})


class Metrics:
    """One ingress replica's /metrics: its own request figures merged with the other ingress
    replicas' (from the monitor's snapshot) and the snapshot's pool and router series."""

    def __init__(self, model_name: str, replica: str = "ingress"):
        self.model_name, self.replica = model_name, replica
        self.local = RequestStats()
        for pool in POOLS:  # present from start-up
            for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                         "vllm:e2e_request_latency_seconds", "vllm:generation_tokens"):
                self.local.touch(name, (model_name, pool))
            for other in POOLS:
                for name in ("keyacc_handoffs", "keyacc_handoff_bytes", "keyacc_handoff_seconds"):
                    self.local.touch(name, (pool, other))
        for reason in REASONS:
            self.local.touch("vllm:request_success", (model_name, reason))
        for name in ("vllm:prompt_tokens", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                     "vllm:request_params_n", "vllm:request_params_max_tokens"):
            self.local.touch(name, (model_name,))
        for kind in ("completion_requests", "chat_requests"):
            self.local.touch("keyacc_http_requests", (kind,))
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.snapshot = SnapshotCollector(model_name, self)
        r.register(self.snapshot)

    def count_http(self, kind: str) -> None:
        self.local.inc("keyacc_http_requests", (kind,))

    def render(self, snap_info: dict | None) -> bytes:
        """The exposition; `snap_info`: the router's snapshot_dict, or None when it did not
        answer (the last one given is used, and keyacc_router_up is 0)."""
        self.snapshot.update(snap_info)
        return generate_latest(self.registry)

    def request_families(self, others: list[dict]):
        """The request series, this replica's figures (now) plus the other replicas' (as last
        reported to the monitor)."""
        counts, hists = RequestStats.merged([self.local.to_dict(), *others])
        for name, (labels, buckets, help_) in REQUEST_SERIES.items():
            if buckets is None:
                f = CounterMetricFamily(name, help_, labels=list(labels))
                for (n, lab), v in sorted(counts.items()):
                    if n == name:
                        f.add_metric(list(lab), v)
            else:
                f = HistogramMetricFamily(name, help_, labels=list(labels))
                for (n, lab), h in sorted(hists.items(), key=lambda x: x[0]):
                    if n == name:
                        f.add_metric(list(lab), *_buckets(h))
            yield f


class RequestTimer:
    """One request's token arrivals at the ingress, observed into its replica's RequestStats when
    each choice ends (its trace tells which pool made which tokens)."""

    __slots__ = ("m", "t0", "arrivals")

    def __init__(self, metrics: Metrics, n_choices: int):
        self.m, self.t0 = metrics, time.monotonic()
        self.arrivals: list[list] = [[] for _ in range(n_choices)]  # per choice: (time, tokens) per chunk

    def tokens(self, k: int, n: int) -> None:
        if n:
            self.arrivals[k].append((time.monotonic(), n))

    def finish(self, k: int, trace: dict, reason: str | None, num_output: int) -> None:
        st, name = self.m.local, self.m.model_name
        pools = [p for s in trace.get("segments", []) for p in [s["pool"]] * int(s.get("tokens", 0))]
        last, i = self.t0, 0
        for t, n in self.arrivals[k]:
            gap = (t - last) / n  # a chunk of n tokens: n gaps of equal share
            for _ in range(n):
                pool = pools[i] if i < len(pools) else (pools[-1] if pools else "gpu")
                if i == 0:
                    st.observe("vllm:time_to_first_token_seconds", (name, pool), t - self.t0)
                else:
                    st.observe("vllm:inter_token_latency_seconds", (name, pool), gap)
                i += 1
            last = t
        counts: dict[str, int] = {}
        for p in pools:
            counts[p] = counts.get(p, 0) + 1
        for pool, n in counts.items():
            st.inc("vllm:generation_tokens", (name, pool), n)
        segs = trace.get("segments", [])
        for prev, seg in zip(segs, segs[1:]):
            if "kv_bytes" in seg:
                ft = (prev["pool"], seg["pool"])
                st.inc("keyacc_handoffs", ft)
                st.inc("keyacc_handoff_bytes", ft, seg["kv_bytes"])
                st.observe("keyacc_handoff_seconds", ft, seg.get("handoff_ms", 0.0) / 1e3)
        st.observe("vllm:e2e_request_latency_seconds", (name, pools[-1] if pools else "gpu"), time.monotonic() - self.t0)
        st.inc("vllm:request_success", (name, reason or "abort"))
        st.observe("vllm:request_generation_tokens", (name,), num_output)

    def prompt(self, num_prompt_tokens: int, n: int = 1, max_tokens: int | None = None) -> None:
        """The request's prompt tokens (each prompt once) and its parameters."""
        st, name = self.m.local, self.m.model_name
        st.inc("vllm:prompt_tokens", (name,), num_prompt_tokens)
        st.observe("vllm:request_prompt_tokens", (name,), num_prompt_tokens)
        st.observe("vllm:request_params_n", (name,), n)
        if max_tokens is not None:
            st.observe("vllm:request_params_max_tokens", (name,), max_tokens)


class SnapshotCollector:
    """The router's snapshot as metric families, built at each scrape."""

    def __init__(self, model_name: str, owner: Metrics):
        self.model_name, self.owner = model_name, owner
        self.info: dict = {}
        self.up = False
        self.last_ok = 0.0

    def update(self, snap_info: dict | None) -> None:
        self.up = snap_info is not None
        if snap_info is not None:
            self.info, self.last_ok = snap_info, time.monotonic()

    def collect(self):
        fams: dict = {}

        def fam(cls, name, help_, labels=(), **kw):
            key = name + "_total" if cls is CounterMetricFamily else name  # (what the exposition names it)
            if key not in fams:
                fams[key] = cls(name, help_, labels=list(labels), **kw)
            return fams[key]

        info = self.info
        snap = info.get("snapshot") or {}
        others = [st for rid, (t, st) in (snap.get("ingress") or {}).items() if rid != self.owner.replica]
        yield from self.owner.request_families(others)
        fam(GaugeMetricFamily, "keyacc_router_up", "1 if the router answered this scrape").add_metric(
            [], 1 if self.up else 0)
        age = info.get("snapshot_age_s", 0) + (time.monotonic() - self.last_ok if self.last_ok else 0)
        fam(GaugeMetricFamily, "keyacc_monitor_snapshot_age_seconds", "age of the router's load snapshot").add_metric(
            [], min(age, 1e9))
        fam(GaugeMetricFamily, "keyacc_requests_held", "new requests waiting at the router for a place on either "
            "pool").add_metric([], info.get("held", 0))
        oldest = fam(GaugeMetricFamily, "keyacc_oldest_request_age_seconds", "per hop (and `held` at the router): "
                     "how long its oldest request has been there (one stuck shows as an age that only grows)", ["hop"])
        for hop, age in sorted((info.get("oldest_s") or {}).items()):
            oldest.add_metric([hop], age)
        self._pools(fam, snap)
        self._replicas(fam, snap)
        gpu = snap.get("gpu") or {}
        fam(GaugeMetricFamily, "keyacc_gpu_available", "1 if pynvml sees a GPU").add_metric(
            [], 1 if gpu.get("available") else 0)
        g_util = fam(GaugeMetricFamily, "keyacc_gpu_utilization_percent", "GPU utilization", ["gpu"])
        g_free = fam(GaugeMetricFamily, "keyacc_gpu_memory_free_bytes", "GPU memory free", ["gpu"])
        for g in gpu.get("gpus", []):
            g_util.add_metric([str(g["index"])], g["util_pct"])
            g_free.add_metric([str(g["index"])], g["mem_free_bytes"])
        c_util = fam(GaugeMetricFamily, "keyacc_cpu_utilization_percent", "CPU utilization per NUMA node",
                     ["numa_node"])
        for n in snap.get("cpu_numa", []):
            c_util.add_metric([str(n["node"])], n["util_pct"])
        self._counters(fam, snap.get("counters") or {})
        yield from fams.values()

    def _pools(self, fam, snap: dict) -> None:
        """Per pool and device kind, summed over the replicas (vLLM's series; vLLM has one engine);
        a pool no replica has reported from yet shows zeros with an empty device."""
        lab = ["model_name", "pool", "device"]
        run = fam(GaugeMetricFamily, "vllm:num_requests_running", "Sequences running, per pool", lab)
        wait = fam(GaugeMetricFamily, "vllm:num_requests_waiting", "Sequences waiting, per pool", lab)
        use = fam(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV cache usage (1 = full), per pool", lab)
        pre = fam(CounterMetricFamily, "vllm:num_preemptions", "Preemptions, per pool", lab)
        q = fam(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", lab)
        h = fam(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", lab)
        hf = {name: fam(HistogramMetricFamily, name, help_, lab) for name, (_, help_) in ENGINE_HISTOGRAMS.items()}
        tot: dict = {}
        for r in snap.get("replicas", []):
            key = (r["pool"], _device_kind(r.get("device", "")))
            t = tot.setdefault(key, {"run": 0, "wait": 0, "free": 0, "blocks": 0, "pre": 0, "q": 0, "h": 0,
                                     "hist": {}})
            t["run"] += r["num_running"]
            t["wait"] += r["num_waiting"]
            t["free"] += r["num_free_blocks"]
            t["blocks"] += r["num_total_blocks"]
            t["pre"] += r.get("num_preemptions", 0)
            t["q"] += r.get("prefix_cache_queries", 0)
            t["h"] += r.get("prefix_cache_hits", 0)
            for name, hist in (r.get("histograms") or {}).items():
                t["hist"][name] = merge_hist(t["hist"].get(name), hist)
        for pool in POOLS:
            if not any(p == pool for p, _ in tot):
                tot[(pool, "")] = {"run": 0, "wait": 0, "free": 0, "blocks": 0, "pre": 0, "q": 0, "h": 0, "hist": {}}
        for (pool, device), t in sorted(tot.items()):
            lab = [self.model_name, pool, device]
            run.add_metric(lab, t["run"])
            wait.add_metric(lab, t["wait"])
            use.add_metric(lab, 1 - t["free"] / t["blocks"] if t["blocks"] else 0.0)
            pre.add_metric(lab, t["pre"])
            q.add_metric(lab, t["q"])
            h.add_metric(lab, t["h"])
            for name, (buckets, _) in ENGINE_HISTOGRAMS.items():
                hf[name].add_metric(lab, *_buckets(t["hist"].get(name), buckets))

    def _replicas(self, fam, snap: dict) -> None:
        keys = ["deployment", "pool", "replica", "emulated"]
        for r in snap.get("replicas", []):
            lab = [r["deployment"], r["pool"], r["replica"], "1" if r["emulated"] else "0"]
            for field, name in REPLICA_GAUGES.items():
                fam(GaugeMetricFamily, name, f"per replica: {field}", keys).add_metric(lab, r[field])
            for field, name, kind, help_ in (
                    ("tokens_generated", "keyacc_tokens_generated", CounterMetricFamily, "per replica: output tokens"),
                    ("num_preemptions", "keyacc_preemptions", CounterMetricFamily,
                     "per replica: sequences that gave up their KV blocks (lazy KV) and are recomputed"),
                    ("prefix_cache_queries", "keyacc_prefix_cache_queries", CounterMetricFamily,
                     "per replica: prompt tokens looked up in the prefix cache"),
                    ("prefix_cache_hits", "keyacc_prefix_cache_hits", CounterMetricFamily,
                     "per replica: prompt tokens found in the prefix cache"),
                    ("prefix_cache_evictions", "keyacc_prefix_cache_evictions", CounterMetricFamily,
                     "per replica: cached KV blocks whose memory was taken for new tokens"),
                    ("steps_launched_ahead", "keyacc_decode_steps_launched_ahead", CounterMetricFamily,
                     "per replica: decode steps launched before the previous step's tokens were read "
                     "(async_scheduling)"),
                    ("kv_export_skipped_tokens", "keyacc_kv_handoff_skipped_tokens", CounterMetricFamily,
                     "per replica: tokens whose K/V a hand-off from here left out (the router expected the "
                     "next pool to cache them)"),
                    ("kv_import_cached_tokens", "keyacc_kv_handoff_cached_tokens", CounterMetricFamily,
                     "per replica: tokens of hand-offs to here found in the prefix cache (shared, not copied)"),
                    ("kv_import_recomputed_tokens", "keyacc_kv_handoff_recomputed_tokens", CounterMetricFamily,
                     "per replica: tokens of hand-offs to here computed again (their package left out blocks "
                     "not cached here)"),
                    ("num_cached_blocks", "keyacc_cached_kv_blocks", GaugeMetricFamily,
                     "per replica: KV blocks holding a cached prefix (in use or free)")):
                fam(kind, name, help_, keys).add_metric(lab, r.get(field, 0))
            fam(GaugeMetricFamily, "keyacc_replica_info", "per replica: its device (value 1)",
                keys + ["device"]).add_metric(lab + [str(r.get("device", ""))], 1)
            tiers = r.get("kv_tiers") or {}
            for tier, t in (tiers.get("tiers") or {}).items():
                tl, tk = lab + [tier], keys + ["tier"]
                fam(CounterMetricFamily, "keyacc_kv_tier_hits", "per replica and lower tier: prompt tokens whose "
                    "KV was loaded from it", tk).add_metric(tl, t["hits"])
                fam(CounterMetricFamily, "keyacc_kv_tier_loaded_bytes", "per replica and lower tier: KV bytes "
                    "loaded from it", tk).add_metric(tl, t["loaded_blocks"] * tiers["block_bytes"])
                fam(CounterMetricFamily, "keyacc_kv_tier_stored_bytes", "per replica and lower tier: KV bytes "
                    "stored into it", tk).add_metric(tl, t["stored_blocks"] * tiers["block_bytes"])
                fam(CounterMetricFamily, "keyacc_kv_tier_evictions", "per replica and lower tier: blocks pushed "
                    "out of it", tk).add_metric(tl, t["evictions"])
                fam(GaugeMetricFamily, "keyacc_kv_tier_blocks", "per replica and lower tier: blocks held",
                    tk).add_metric(tl, t["blocks"])
                fam(GaugeMetricFamily, "keyacc_kv_tier_load_bandwidth_bytes_per_second", "per replica and lower "
                    "tier: how fast its blocks load into the pool lately (0: not measured yet)",
                    tk).add_metric(tl, t.get("bandwidth", 0.0))
            if tiers:
                fam(CounterMetricFamily, "keyacc_kv_tier_recomputed_blocks", "per replica: blocks held in a lower "
                    "tier but computed again", keys).add_metric(lab, tiers["recomputed_blocks"])

    @staticmethod
    def _counters(fam, counters: dict) -> None:
        """The router's counters (`name|k=v,...` keys), the known label sets at zero if absent."""
        seen: dict[str, dict[tuple, float]] = {}
        for key, v in counters.items():
            name, _, lab = key.partition("|")
            labels = dict(kv.split("=", 1) for kv in lab.split(",") if kv)
            seen.setdefault(name, {})[tuple(sorted(labels.items()))] = v
        for name, sets in KNOWN_COUNTERS.items():
            got = seen.setdefault(name, {})
            for s in sets:
                got.setdefault(tuple(sorted(s.items())), 0)
        for name, samples in sorted(seen.items()):
            base = name[:-len("_total")] if name.endswith("_total") else name
            names = sorted({k for labels in samples for k, _ in labels})
            f = fam(CounterMetricFamily, f"keyacc_{base}", f"router: {name}", names)
            for labels, v in sorted(samples.items()):
                d = dict(labels)
                f.add_metric([d.get(k, "") for k in names], v)


def _device_kind(device: str) -> str:
    """A replica's device as a label: "cuda", "cpu", or what it says ("cpu (emulated GPU ...)")."""
    d = str(device)
    return "cuda" if d.startswith("cuda") else d.split(" ")[0] or "unknown"


def _buckets(h: dict | None, empty=REQUEST_BUCKETS) -> tuple[list, float]:
    """(cumulative [(le, count)...], sum) for HistogramMetricFamily.add_metric (`empty`: the
    bounds of a histogram nothing reported yet)."""
    bounds = h["buckets"] if h else list(empty)
    counts = h["counts"] if h else [0] * (len(bounds) + 1)
    out, run = [], 0
    for le, c in zip([*map(str, map(float, bounds)), "+Inf"], counts):
        run += c
        out.append((le, run))
    return out, (h["sum"] if h else 0.0)
