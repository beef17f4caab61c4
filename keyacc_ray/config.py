"""Validated configuration objects, one per concern. Units are in the names."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields


class ConfigError(ValueError):
    pass


def _from_dict(cls, d: dict | None):
    d = dict(d or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**d)


@dataclass
class EngineConfig:
    """One engine (one replica): model, device and KV budget."""

    model: str
    dtype: str = "auto"  # auto (the checkpoint's own), float32, bfloat16, float16
    device: str = "cpu"  # cpu, cuda, cuda:N, auto
    max_num_seqs: int = 32  # KV slots: the most sequences decoding at once
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # default: enough for every slot at max_model_len
    max_waiting: int = 256  # bounded waiting queue
    # sequences whose stream is under way (moved here mid-stream: a hand-off, a failover from a
    # dead replica) may run past max_num_seqs by this many while KV blocks last, each step slower
    # for all instead of those streams stalling until places free (a GPU replica's death moves all
    # its streams at once). Fresh prompts never use these places. Not where decode steps are CUDA
    # graphs (captured up to max_num_seqs rows). Off by default until a soak's one wrong
    # completion beside it is understood (docs/benchmarks.md, Soak, "Session 44").
    max_num_seqs_under_way: int = 0  # 0: off
    # prompt tokens fed per step in all (chunked prefill: a longer prompt goes in chunks of what is
    # left, beside the step's decode rows; vLLM's max_num_batched_tokens less the decode rows)
    max_prefill_tokens: int = 4096
    batched_prefill: bool = True  # a step's prompt chunks in the decode rows' forward (off: one forward each)
    num_threads: int | None = None  # torch intra-op threads
    kv_export_layout: str = "LHTD"
    kv_memory_fraction: float = 0.85  # CPU: share of available RAM the KV block pool may take
    # CUDA: share of the whole device for weights, activations (a profiled forward) and KV, as vLLM
    gpu_memory_utilization: float = 0.9
    # paged attention over the block pool (auto: where the load probe shows it matches the model's
    # own attention; off: the model's own attention over gathered KV)
    paged_attention: str = "auto"
    # decode steps at fixed batch sizes over static buffers (auto: captured as CUDA graphs on CUDA,
    # vLLM's default; on: also the same static-buffer step on CPU, eagerly; off: eager, vLLM's
    # enforce_eager). On CPU the fused decode step of the fast path takes precedence.
    decode_graphs: str = "auto"
    # asynchronous scheduling (vLLM's --async-scheduling): in a run of decode steps over the
    # static buffers (decode_graphs), step n+1 is launched from step n's sampled ids on the device
    # before they are read, and step n is postprocessed while n+1 runs. Steps with prompt tokens,
    # requests waiting for a free slot, logprobs, penalties, a logit bias, min_tokens or a grammar
    # run as before. Same tokens either way. None: on where decode steps replay CUDA graphs (as
    # vLLM, on by default since late 2025; on the H200 it took the 14B shape from 3,820 to 4,759
    # tokens/s at 64 sequences, docs/benchmarks.md), off elsewhere; true / false force it.
    async_scheduling: bool | None = None
    # after a step with prompt tokens, fresh prompts wait this many times that step's duration
    # while sequences decode (vLLM v0's scheduler_delay_factor): prompts arriving meanwhile share
    # one eager step instead of making one each. None: 1.0 where decode steps replay CUDA graphs
    # (an eager step costs many graph steps), else 0 (off)
    prefill_delay_factor: float | None = None
    cpu_kernels: str = "auto"  # CPU fast path (keyacc_ray/kernels): auto (where it builds and checks out), on, off
    cpu_weight_quant: str = "none"  # none, or int8: weight-only int8 (per-row scales) for bf16 linears on the fast path
    trust_remote_code: bool = False  # run the model repository's own Python code (transformers' flag)
    # KV blocks: "lazy" as a sequence grows, preempting the newest when they run out (vLLM), or
    # "reserve" prompt + max_tokens at admission (never preempts; fewer sequences at once).
    kv_allocation: str = "lazy"
    # lazy KV: a sequence is admitted only while the free blocks also cover a share of what the
    # running ones may still generate (SGLang's new-token ratio: adaptive, back up after each
    # preemption; scheduler.GrowthReserve): fewer preemptions, fewer streams stalled mid-way
    kv_growth_reserve: bool = False
    # automatic prefix caching (vLLM's): a prompt that begins with blocks another sequence computed
    # shares their KV and prefills only the rest
    enable_prefix_caching: bool = True
    # KV tiers below the block pool (with prefix caching): cached blocks evicted from it go to host
    # memory (pinned, on CUDA), and from there to a file under kv_disk_tier_dir (default: the temp
    # dir); a later prompt loads them back where that is cheaper than computing them. 0: no tier.
    kv_host_tier_gb: float = 0.0
    kv_disk_tier_gb: float = 0.0
    kv_disk_tier_dir: str | None = None
    # The node's shared KV tier (engine/node_tier.py): host memory every engine on the machine with
    # the same KV format reads and writes (GPU and CPU pools alike). Every full block an engine
    # computed goes there when its sequence finishes or leaves with a hand-off; a prompt's head
    # found there is loaded instead of computed, and a hand-off leaves those blocks out of its
    # package. Its directory defaults to /dev/shm/keyacc-kv (where it has room). 0: none.
    kv_node_tier_gb: float = 0.0
    kv_node_tier_dir: str | None = None
    # Blocks a prompt's head finds in a lower tier: "auto" loads them where the cost model finds
    # that cheaper than computing them again (their bytes over the tier's measured bandwidth
    # against the engine's measured prefill rate; a tiny model on a fast CPU computes a block
    # about as fast as a copy's fixed cost, so the choice there goes either way); "always" loads
    # whatever is found (a pool whose cores are better spent decoding others than recomputing).
    kv_tier_load: str = "auto"

    def __post_init__(self):
        if not self.model:
            raise ConfigError("EngineConfig.model is required")
        for name in ("max_num_seqs", "kv_block_size", "max_waiting", "max_prefill_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"EngineConfig.{name} must be an integer >= 1, got {v!r}")
        v = self.max_num_seqs_under_way
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"EngineConfig.max_num_seqs_under_way must be an integer >= 0, got {v!r}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"EngineConfig.{name} must be None or an integer >= 1, got {v!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"EngineConfig.dtype must be auto/float32/bfloat16/float16, got {self.dtype!r}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ConfigError(f"EngineConfig.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.paged_attention not in ("auto", "off"):
            raise ConfigError(f"EngineConfig.paged_attention must be auto/off, got {self.paged_attention!r}")
        v = self.prefill_delay_factor
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 100):
            raise ConfigError(f"EngineConfig.prefill_delay_factor must be None or a number in [0, 100], got {v!r}")
        if self.decode_graphs not in ("auto", "on", "off"):
            raise ConfigError(f"EngineConfig.decode_graphs must be auto/on/off, got {self.decode_graphs!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"EngineConfig.async_scheduling must be null/true/false, got {self.async_scheduling!r}")
        if self.cpu_kernels not in ("auto", "on", "off"):
            raise ConfigError(f"EngineConfig.cpu_kernels must be auto/on/off, got {self.cpu_kernels!r}")
        for name in ("enable_prefix_caching", "kv_growth_reserve"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name} must be true/false, got {getattr(self, name)!r}")
        for name in ("kv_host_tier_gb", "kv_disk_tier_gb", "kv_node_tier_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1 << 20:
                raise ConfigError(f"EngineConfig.{name} must be a number of GiB >= 0, got {v!r}")
        if self.kv_tier_load not in ("auto", "always"):
            raise ConfigError(f"EngineConfig.kv_tier_load must be auto/always, got {self.kv_tier_load!r}")
        if self.kv_allocation not in ("lazy", "reserve"):
            raise ConfigError(f"EngineConfig.kv_allocation must be lazy/reserve, got {self.kv_allocation!r}")
        if self.cpu_weight_quant not in ("none", "int8"):
            raise ConfigError(f"EngineConfig.cpu_weight_quant must be none/int8, got {self.cpu_weight_quant!r}")
        if self.kv_export_layout not in ("LHTD", "LTHD"):
            raise ConfigError(f"EngineConfig.kv_export_layout must be LHTD or LTHD, got {self.kv_export_layout!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        return _from_dict(cls, d)

    def replace(self, **kw) -> "EngineConfig":
        return EngineConfig(**{**asdict(self), **kw})


def env_model(default: str) -> str:
    """KEYACC_MODEL overrides the configured model (a local path or a hub id)."""
    return os.environ.get("KEYACC_MODEL") or default


def env_dtype(default: str) -> str:
    return os.environ.get("KEYACC_DTYPE") or default


def env_trust_remote_code(default: bool) -> bool:
    """KEYACC_TRUST_REMOTE_CODE=1 (or true) lets a model repository's own code run."""
    v = os.environ.get("KEYACC_TRUST_REMOTE_CODE", "").strip().lower()
    return v in ("1", "true", "yes") if v else default


def _keys(env_var: str, file_env_var: str, path: str | None = None) -> frozenset[str]:
    keys = [k.strip() for k in os.environ.get(env_var, "").split(",")]
    for p in (os.environ.get(file_env_var), path):
        if p:
            with open(p, encoding="utf-8") as f:
                keys += [line.strip() for line in f]
    return frozenset(k for k in keys if k and not k.startswith("#"))


def env_api_keys(path: str | None = None) -> frozenset[str]:
    """Client API keys: KEYACC_API_KEYS (comma-separated), KEYACC_API_KEYS_FILE and/or the
    app's `api_keys_file` (one per line). None at all: the server is open. Keys are compared in
    constant time and never logged."""
    return _keys("KEYACC_API_KEYS", "KEYACC_API_KEYS_FILE", path)


def env_operator_keys(path: str | None = None) -> frozenset[str]:
    """Operator keys (KEYACC_OPERATOR_KEYS, KEYACC_OPERATOR_KEYS_FILE, `operator_keys_file`):
    they may use the `keyacc` routing extension when `allow_route_pinning` is "operators"."""
    return _keys("KEYACC_OPERATOR_KEYS", "KEYACC_OPERATOR_KEYS_FILE", path)
