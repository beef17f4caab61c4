"""Prometheus text for GET /metrics, rendered from the monitor's snapshot and counters."""
from __future__ import annotations


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _labels(d: dict) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}" if d else ""


REPLICA_GAUGES = {
    "num_waiting": "keyacc_queue_depth", "num_running": "keyacc_running_sequences",
    "num_free_blocks": "keyacc_free_kv_blocks", "num_total_blocks": "keyacc_total_kv_blocks",
    "tokens_per_s": "keyacc_tokens_per_second",
}


def render(snap_info: dict, ingress_counts: dict) -> str:
    families: dict[str, list[str]] = {}  # a family's samples must stay together

    def emit(name, kind, labels, value, help_=""):
        if name not in families:
            families[name] = [f"# HELP {name} {help_ or name}", f"# TYPE {name} {kind}"]
        families[name].append(f"{name}{_labels(labels)} {float(value)}")

    snap = (snap_info or {}).get("snapshot") or {}
    emit("keyacc_monitor_snapshot_age_seconds", "gauge", {}, min(snap_info.get("snapshot_age_s", 0), 1e9),
         "age of the router's load snapshot")
    emit("keyacc_requests_held", "gauge", {}, snap_info.get("held", 0),
         "new requests waiting at the router for a place on either pool")
    for r in snap.get("replicas", []):
        labels = {"deployment": r["deployment"], "pool": r["pool"], "replica": r["replica"],
                  "emulated": "1" if r["emulated"] else "0"}
        for field, name in REPLICA_GAUGES.items():
            emit(name, "gauge", labels, r[field], f"per replica: {field}")
        emit("keyacc_tokens_generated_total", "counter", labels, r["tokens_generated"])
        emit("keyacc_preemptions_total", "counter", labels, r.get("num_preemptions", 0),
             "per replica: sequences that gave up their KV blocks (lazy KV) and are recomputed")
        emit("keyacc_prefix_cache_queries_total", "counter", labels, r.get("prefix_cache_queries", 0),
             "per replica: prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)")
        emit("keyacc_prefix_cache_hits_total", "counter", labels, r.get("prefix_cache_hits", 0),
             "per replica: prompt tokens found in the prefix cache (vLLM's prefix_cache_hits)")
        emit("keyacc_prefix_cache_evictions_total", "counter", labels, r.get("prefix_cache_evictions", 0),
             "per replica: cached KV blocks whose memory was taken for new tokens")
        emit("keyacc_cached_kv_blocks", "gauge", labels, r.get("num_cached_blocks", 0),
             "per replica: KV blocks holding a cached prefix (in use or free)")
        tiers = r.get("kv_tiers") or {}
        for tier, t in (tiers.get("tiers") or {}).items():
            tl = {**labels, "tier": tier}
            emit("keyacc_kv_tier_hits_total", "counter", tl, t["hits"],
                 "per replica and lower tier: prompt tokens whose KV was loaded from it")
            emit("keyacc_kv_tier_loaded_bytes_total", "counter", tl, t["loaded_blocks"] * tiers["block_bytes"],
                 "per replica and lower tier: KV bytes loaded from it into the block pool")
            emit("keyacc_kv_tier_stored_bytes_total", "counter", tl, t["stored_blocks"] * tiers["block_bytes"],
                 "per replica and lower tier: KV bytes stored into it (evicted from the tier above)")
            emit("keyacc_kv_tier_evictions_total", "counter", tl, t["evictions"],
                 "per replica and lower tier: blocks pushed out of it (down a tier, or dropped)")
            emit("keyacc_kv_tier_blocks", "gauge", tl, t["blocks"], "per replica and lower tier: blocks held")
        if tiers:
            emit("keyacc_kv_tier_recomputed_blocks_total", "counter", labels, tiers["recomputed_blocks"],
                 "per replica: blocks held in a lower tier but computed again (cheaper than loading them)")
    gpu = snap.get("gpu") or {}
    emit("keyacc_gpu_available", "gauge", {}, 1 if gpu.get("available") else 0, "1 if pynvml sees a GPU")
    for g in gpu.get("gpus", []):
        emit("keyacc_gpu_utilization_percent", "gauge", {"gpu": g["index"]}, g["util_pct"])
        emit("keyacc_gpu_memory_free_bytes", "gauge", {"gpu": g["index"]}, g["mem_free_bytes"])
    for n in snap.get("cpu_numa", []):
        emit("keyacc_cpu_utilization_percent", "gauge", {"numa_node": n["node"]}, n["util_pct"])
    for key, v in sorted((snap.get("counters") or {}).items()):
        name, _, lab = key.partition("|")
        labels = dict(kv.split("=", 1) for kv in lab.split(",") if kv)
        emit(f"keyacc_{name}", "counter", labels, v)
    for key, v in sorted(ingress_counts.items()):
        emit("keyacc_http_requests_total", "counter", {"kind": key}, v)
    return "\n".join(line for fam in families.values() for line in fam) + "\n"
