"""The model forward on one device: every torch / CUDA detail of the engine lives here.

Any transformers decoder-only model runs unmodified. The KV cache is physical paged memory: per
layer one pool of fixed-size blocks (`engine/paged_attention.py`), a sequence's tokens in the
blocks of its table (kept by `engine/blocks.py`: the accounting is the memory). Nothing is
reserved per sequence, nothing is copied when one finishes.

A step is a list of `StepItem`s (decode tokens and prompt chunks, chunked prefill mixed with
decodes) run as one packed forward whose attention reads the pool through block tables
("keyacc_paged"), where a load probe shows the model's attention goes through transformers'
attention interface and agrees with its own; otherwise (eager-only attention such as Gemma2's
soft-capping, multi-head latent attention that attends over its cached latent itself) the
model's own attention runs over keys gathered from the pool with 4D masks: decode rows in one
batch, each prompt chunk in a forward of its own. On CPU with the kernels built, a step of
decode rows alone runs the fused decode step over the pool.
"""
from __future__ import annotations

import inspect
import itertools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from keyacc_ray.engine.decode_graphs import StaticDecode
from keyacc_ray.engine.paged_attention import ATTN_NAME, PagedAttention, PagedKVCache, StepBatch, active, gather, register
from keyacc_ray.errors import ModelLoadError

log = logging.getLogger(__name__)

# a fresh prompt chunk this long goes through SDPA with is_causal (flash attention on CUDA, no mask)
# rather than the Triton prefill kernel, whose small tiles suit many short chunks and continuations
FLASH_PROMPT_TOKENS = 1024

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


PROBE_TOL = {torch.float32: 1e-3, None: 3e-2}  # the paged probe's relative error allowed outright, by dtype


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (norm-wise; 0 where both are 0)."""
    return float((a - b).norm()) / max(float(b.norm()), 1e-12)


def _fmt(errs: list[float] | None) -> str:
    return "-" if errs is None else "[" + ", ".join(f"{e:.4f}" for e in errs) + "]"


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int  # of the keys
    dtype: torch.dtype
    v_head_dim: int = 0  # of the values, where it differs (multi-head latent attention); 0: head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim


class _ShapeProbe:
    """A cache that records the key/value shapes each attention layer hands it (and attends
    over the current tokens only): what the KV buffers must hold, read from the model itself
    rather than from config attribute names that differ between architectures."""

    is_compileable = False

    def __init__(self):
        self.shapes: dict[int, tuple[int, int, int]] = {}  # layer -> (kv_heads, k_dim, v_dim)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        assert key_states.shape[1] == value_states.shape[1], "keys and values with different head counts"
        self.shapes[layer_idx] = (key_states.shape[1], key_states.shape[3], value_states.shape[3])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def load_model(model: str, dtype: torch.dtype, trust_remote_code: bool = False):
    """transformers' model with SDPA attention, or its eager attention for an architecture
    that has no SDPA path (Gemma2's logit soft-capping, Bloom's ALiBi, ...): both take the
    additive 4D masks the runner builds."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa",
                                                    trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "attention implementation" not in str(e):
            raise
        log.warning("%s: no SDPA attention in this architecture; using its eager attention", model)
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager",
                                                    trust_remote_code=trust_remote_code)


def cache_kwarg(model) -> str:
    """The forward argument that takes the KV cache: `cache` in transformers >= 5.2x,
    `past_key_values` before (and in remote-code models). Passed under the wrong name, the cache
    lands in **kwargs unused and the model attends over the current token alone."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise ModelLoadError(f"{type(model).__name__}.forward takes no KV cache argument (cache / past_key_values)",
                         param="model")


@dataclass(slots=True)
class StepItem:
    """One sequence's part of a forward: `tokens` fed at positions start.., their KV written into
    `blocks` (the sequence's block table, covering start + len(tokens)); `logits`: which rows of
    logits come back ("last", "all" for scoring a prompt, "none" for a prompt chunk that is not
    its last)."""

    tokens: list[int]
    start: int
    blocks: list[int]
    logits: str = "last"
    row: int = -1  # the table's row in the runner's `block_array` (-1: none; `blocks` is read)

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1 and self.start > 0

    @property
    def num_logits(self) -> int:
        return 1 if self.logits == "last" else (len(self.tokens) if self.logits == "all" else 0)


class ModelRunner:
    def __init__(self, model: str, dtype: str, device: str, max_num_seqs: int, max_model_len: int | None,
                 num_threads: int | None = None, kv_memory_fraction: float = 0.85, cpu_kernels: str = "off",
                 cpu_weight_quant: str = "none", trust_remote_code: bool = False, block_size: int = 16,
                 num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_batched_tokens: int = 4096, paged_attention: str = "auto", decode_graphs: str = "auto"):
        from transformers import AutoConfig

        if decode_graphs not in ("auto", "on", "off"):
            raise ModelLoadError(f"decode_graphs must be auto/on/off, got {decode_graphs!r}", param="decode_graphs")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = resolve_device(device)
        try:
            hf_config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - any loader failure is the user's path/id
            raise ModelLoadError(f"cannot load model {model!r}: {e}", param="model") from e
        if dtype == "auto":
            torch_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
            torch_dtype = DTYPES.get(str(torch_dtype).replace("torch.", ""), torch.float32)
        else:
            torch_dtype = DTYPES[dtype]
        if self.device.type == "cpu" and torch_dtype == torch.float16:
            log.warning("float16 on CPU is slow; consider bfloat16")
        self.model = load_model(model, torch_dtype, trust_remote_code).to(self.device).eval()
        self._own_attn = self.model.config._attn_implementation
        self._cache_kw = cache_kwarg(self.model)
        cfg = self.model.config
        self.hf_config = cfg
        self.dtype = torch_dtype
        self.vocab_size = cfg.vocab_size
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
        self.max_model_len = min(max_model_len or limit, limit)
        self.max_num_seqs = max_num_seqs
        self.layer_types = getattr(cfg, "layer_types", None)
        self.sliding_window = getattr(cfg, "sliding_window", None)
        self._min = torch.finfo(torch_dtype).min
        self.kv_shape = self._probe_kv_shape()
        self.block_size = block_size
        self.fast_path = None  # what keyacc_ray.kernels swapped in (FastPathReport)
        self.fused_step = None  # FusedDecodeStep once it reproduced the model's own logits
        # the block manager's tables as one array (BlockManager.array), rows named by StepItem.row
        self.block_array: np.ndarray | None = None
        self._kernels = None
        self.paged = False  # until the probe below shows the paged attention agrees with the model's
        self.probe_error = None  # the probe's ([relative error per output], [its yardstick] or None)
        # CUDA: {"projections": groups, "rms_norm": {"fused": n, "kept": m}, "rotary": "fused" or
        # "kept: <why>"}, or None.
        # Before the block pool is sized: the fused weights are new tensors (the old ones freed),
        # and the profiled step that sizes the pool is then the fused model's
        self.fused_ops = self._fuse_ops()
        self.num_blocks = self._fit_blocks(num_kv_blocks, kv_memory_fraction, gpu_memory_utilization,
                                           max_num_batched_tokens)
        s = self.kv_shape
        # one block more than the block manager hands out: the pad block, where the padding rows of
        # a fixed-size decode step write their keys (engine/decode_graphs.py)
        self.pad_block = self.num_blocks
        self.cache = PagedKVCache(s.num_layers, self.num_blocks + 1, s.num_kv_heads, block_size, s.head_dim,
                                  s.v_dim, self.dtype, self.device, zeros=self._cpu_zeros(cpu_kernels))
        self.windows = [self._window(i) for i in range(s.num_layers)]
        if self.device.type == "cpu" and cpu_kernels != "off":
            self._enable_cpu_kernels(required=cpu_kernels == "on",
                                     quant=None if cpu_weight_quant == "none" else cpu_weight_quant)
        self.attn = PagedAttention(self.cache, self.windows, self._kernels)
        self.attn.kernel = self._choose_attention_kernel()
        if self.attn.kernel == "triton":
            from keyacc_ray.engine import triton_attention

            self.cache.write = triton_attention.write_kv
        self.paged = paged_attention != "off" and self._try_paged()
        self._check_cache_used()
        self.static_decode: StaticDecode | None = None  # decode steps at bucket sizes (CUDA graphs)
        if self.paged and self.fused_step is None and (
                decode_graphs == "on" or (decode_graphs == "auto" and self.device.type == "cuda")):
            self.static_decode = StaticDecode(max_num_seqs, self.max_blocks_per_seq, block_size, self.pad_block,
                                              self.device, self._static_step)
            self.static_decode.capture()

    @property
    def max_blocks_per_seq(self) -> int:
        """The widest block table: the block manager's array has this many columns."""
        return min(self.num_blocks, -(-self.max_model_len // self.block_size))

    @property
    def graphs_captured(self) -> list[int]:
        """The batch sizes whose decode step replays a CUDA graph."""
        return sorted(self.static_decode.graphs) if self.static_decode else []

    def _choose_attention_kernel(self) -> str:
        """Attention over the pool: on CPU the CPU kernel for decode rows where built; on CUDA the
        Triton kernels (decode rows, prompt chunks) where triton runs and its decode kernel agrees
        with the torch reference on this pool's shapes (the load probe then checks both against the
        model's own attention); else the torch reference (logged). KEYACC_DECODE_ATTENTION=triton|torch
        forces one (triton on CPU runs under TRITON_INTERPRET=1: the tests')."""
        from keyacc_ray.engine import triton_attention

        forced = os.environ.get("KEYACC_DECODE_ATTENTION", "")
        if forced not in ("", "triton", "torch"):
            raise ModelLoadError(f"KEYACC_DECODE_ATTENTION must be triton or torch, got {forced!r}")
        if forced == "torch":
            return "torch"
        if forced != "triton" and self.device.type == "cpu":
            return "cpu" if self._kernels is not None else "torch"
        s = self.kv_shape
        if not triton_attention.available(self.device):
            log.warning("attention over the KV pool: torch reference (%s)", triton_attention.unavailable_reason())
            return "torch"
        try:
            ok = triton_attention.self_check(self.device, self.dtype, s.num_kv_heads,
                                             self.hf_config.num_attention_heads, s.head_dim, s.v_dim, self.block_size)
        except Exception as e:  # noqa: BLE001 - a kernel that does not build here
            log.warning("attention over the KV pool: torch reference (triton kernel failed: %s: %s)",
                        type(e).__name__, e)
            return "torch"
        if not ok:
            log.warning("attention over the KV pool: torch reference (triton kernel disagrees with it here)")
            return "torch"
        return "triton"

    def _fuse_ops(self) -> dict | None:
        """CUDA: the projections that read the same input as one product each (q/k/v, gate/up:
        engine/fused_linear.py), and, where triton runs, the model's RMSNorm modules and its rotary
        embedding as one Triton kernel each (engine/triton_norm.py, engine/triton_rope.py).
        KEYACC_GPU_FUSE=triton|torch forces them or turns them off (triton on CPU runs under
        TRITON_INTERPRET=1: the tests')."""
        from keyacc_ray.engine import fused_linear, triton_attention, triton_norm, triton_rope

        forced = os.environ.get("KEYACC_GPU_FUSE", "")
        if forced not in ("", "triton", "torch"):
            raise ModelLoadError(f"KEYACC_GPU_FUSE must be triton or torch, got {forced!r}")
        if forced == "torch" or (forced != "triton" and self.device.type != "cuda"):
            return None
        got: dict = {"projections": fused_linear.fuse_projections(self.model), "rms_norm": None, "rotary": None}
        if triton_attention.available(self.device):
            try:
                got["rms_norm"] = triton_norm.fuse_rms_norms(self.model, self.device, self.dtype)
                got["rotary"] = triton_rope.fuse_rotary(self.model, self.device, self.dtype)
            except Exception as e:  # noqa: BLE001 - a kernel that does not build here: the model's own ops
                log.warning("fused GPU kernels not used (%s: %s)", type(e).__name__, e)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the separate weights' freed memory, back before the pool is sized
        log.info("fused on %s: %s", self.device, got)
        return got

    def _window(self, layer: int) -> int:
        """The sliding window of a layer (0: it attends over everything), by the same rule the
        masks of the model's own attention follow."""
        if self.layer_types and layer < len(self.layer_types):
            return int(self.sliding_window or 0) if self.layer_types[layer] == "sliding_attention" else 0
        if self.layer_types is None and self.sliding_window:
            return int(self.sliding_window)
        return 0

    @torch.inference_mode()
    def _probe_kv_shape(self) -> KVShape:
        """One 2-token forward through a recording cache: the heads and head sizes of what every
        attention layer caches. A model whose layers keep other state (Mamba / convolution
        layers of hybrid models) fails here with a clear error, not on its first request."""
        name = type(self.model).__name__
        probe = _ShapeProbe()
        pos = torch.arange(2, device=self.device)[None]
        try:
            self.model(input_ids=torch.tensor([[1, 2]], device=self.device), position_ids=pos,
                       attention_mask=self._masks(pos, 2), use_cache=True, logits_to_keep=1,
                       **{self._cache_kw: probe})
        except Exception as e:  # noqa: BLE001 - whatever the architecture needs beyond a KV cache
            raise ModelLoadError(f"{name} does not run on keyacc's KV cache and 4D attention masks "
                                 f"({type(e).__name__}: {e}); supported: decoders whose layers are all "
                                 "attention (no recurrent / convolution state, no ALiBi from a 2D mask)",
                                 param="model") from e
        n = self.model.config.num_hidden_layers
        shapes = set(probe.shapes.values())
        if not shapes:
            raise ModelLoadError(f"{name} passed nothing to the KV cache; not supported", param="model")
        if len(shapes) > 1 or max(probe.shapes) >= n:
            raise ModelLoadError(f"{name} caches differently shaped keys/values per layer {sorted(shapes)}; "
                                 "not supported", param="model")
        heads, kdim, vdim = shapes.pop()
        return KVShape(n, heads, kdim, self.dtype, 0 if vdim == kdim else vdim)

    def _probe_items(self) -> list[StepItem]:
        """Probe sequences over the last blocks of the pool: two prompts, one continued by a chunk
        (attends over cached blocks), decode rows of different lengths; spans several blocks."""
        bs, nb = self.block_size, self.num_blocks
        g = torch.Generator().manual_seed(11)
        lens = [min(2 * bs + 3, max(2, bs * max(1, nb // 4) - 2)), 5]
        items, first = [], nb
        for n in lens:
            need = -(-(n + 2) // bs)
            if first - need < 0:
                break
            blocks = list(range(first - need, first))
            first -= need
            items.append(StepItem(torch.randint(0, self.vocab_size, (n,), generator=g).tolist(), 0, blocks))
        return items

    def _run_probe(self, paged: bool) -> list[torch.Tensor]:
        self.paged = paged
        items = self._probe_items()
        head = [StepItem(it.tokens[:-2], 0, it.blocks, "all") for it in items]
        out = [self.forward(head)]
        tail = [StepItem(it.tokens[-2:], len(it.tokens) - 2, it.blocks, "all") for it in items]
        out.append(self.forward(tail))
        dec = [StepItem([7], len(it.tokens), it.blocks) for it in items]
        out.append(self.forward(dec))
        return [o.float() for o in out]

    def _try_paged(self) -> bool:
        """Run the probe through the model's own attention over gathered KV and through the paged
        attention; keep the paged path only if every layer went through it and the logits agree."""
        if not self._probe_items():
            return False
        register()
        fused, self.fused_step = self.fused_step, None  # the model's forward is what is probed
        try:
            return self._probe_paged()
        finally:
            self.fused_step = fused

    def _probe_paged(self) -> bool:
        try:
            ref = self._run_probe(False)
            self.model.set_attn_implementation(ATTN_NAME)
            self.attn.calls = 0
            got = self._run_probe(True)
            calls = self.attn.calls
        except Exception as e:  # noqa: BLE001 - not this model's attention: its own, over gathered KV
            log.info("paged attention not used for %s (%s: %s); its own attention over gathered KV",
                     type(self.model).__name__, type(e).__name__, e)
            self._restore_attn()
            return False
        tol = PROBE_TOL.get(self.dtype, PROBE_TOL[None])
        err = [_rel_err(a, b) for a, b in zip(got, ref)]
        ok = calls == 3 * self.kv_shape.num_layers and max(err) <= tol
        floor = None
        if calls == 3 * self.kv_shape.num_layers and not ok:
            # A deep model in bf16 amplifies rounding layer by layer (random weights most: the
            # 14B shape's 40 layers put kernels that differ only in rounding 3-5% apart in its
            # logits). The yardstick is then how far two of the model's own attention
            # implementations are apart on the same probe: within twice that, the paged
            # attention differs from the model's as the model's own kernels differ from each other.
            floor = self._probe_floor(ref)
            ok = floor is not None and all(e <= max(tol, 2 * f) for e, f in zip(err, floor)) and max(err) < 0.5
        if not ok:
            log.warning("paged attention disagrees with %s's own attention (calls %d, relative error %s, its "
                        "own implementations apart by %s); using its own over gathered KV",
                        type(self.model).__name__, calls, _fmt(err), _fmt(floor))
            self._restore_attn()
        elif floor is not None:
            log.info("paged attention: relative error %s against %s's own attention, whose own implementations "
                     "are apart by %s on the same probe", _fmt(err), type(self.model).__name__, _fmt(floor))
        self.probe_error = (err, floor)
        return ok

    def _probe_floor(self, ref: list[torch.Tensor]) -> list[float] | None:
        """The probe through another implementation of the model's own attention (eager, or SDPA
        where eager is its own; the fused step off, as `_try_paged` holds it): each output's
        relative distance from `ref`; None where the model has no other."""
        other = "sdpa" if self._own_attn == "eager" else "eager"
        try:
            self.model.set_attn_implementation(other)
            alt = self._run_probe(False)
        except Exception as e:  # noqa: BLE001 - a model with one implementation only
            log.info("no %s attention for %s (%s); no yardstick for the paged probe", other,
                     type(self.model).__name__, e)
            return None
        finally:
            self.model.set_attn_implementation(ATTN_NAME)  # (what the caller probed through)
        return [_rel_err(a, b) for a, b in zip(alt, ref)]

    def _restore_attn(self) -> None:
        self.paged = False
        try:
            self.model.set_attn_implementation(self._own_attn)
        except Exception:  # noqa: BLE001
            self.model.config._attn_implementation = self._own_attn

    def _check_cache_used(self) -> None:
        """A probe forward must write its keys into the pool: a model (or transformers version)
        that takes the cache under another name would otherwise attend over the current tokens
        alone and produce fluent garbage with no error."""
        blk = self.num_blocks - 1
        for buf in self.cache.k:
            buf[blk].zero_()
        self.forward([StepItem([1, 2], 0, [blk])])
        if not bool(self.cache.k[0][blk, :, :2].abs().sum() > 0):
            raise ModelLoadError(f"{type(self.model).__name__} did not write the KV cache passed as "
                                 f"{self._cache_kw!r}; this transformers version or model is not supported",
                                 param="model")

    # ---- CPU fast path -----------------------------------------------------------------
    def _cpu_zeros(self, cpu_kernels: str):
        """The CPU kernels' allocator on 2 MB pages for a CPU pool (None: torch.zeros)."""
        if self.device.type != "cpu" or cpu_kernels == "off":
            return None
        from keyacc_ray import kernels

        mod = kernels.load()
        return getattr(mod, "zeros_huge", None)

    def _enable_cpu_kernels(self, required: bool, quant: str | None) -> None:
        from keyacc_ray import kernels

        mod = kernels.load()
        if mod is None:
            if required:
                raise ModelLoadError(f"cpu_kernels=on but the kernels did not build: {kernels.unavailable_reason()}")
            return
        from keyacc_ray.kernels import fastpath
        from keyacc_ray.kernels.fused_step import FusedDecodeStep

        self._kernels = mod
        self.fast_path = fastpath.apply(self.model, mod, quant=quant)
        try:
            step = FusedDecodeStep.build(self.model, mod)
        except Exception as e:  # noqa: BLE001 - an unusual model: transformers' forward it is
            log.warning("fused decode step not built for this model: %s", e)
            step = None
        if step is not None and self._check_fused_step(step):
            self.fused_step = step
        log.info("CPU kernels: %s fused_step=%s", self.fast_path.summary(), self.fused_step is not None)

    def _check_fused_step(self, step) -> bool:
        """Run one decode step both ways on probe sequences; keep the fused step only if its
        logits and KV writes match the model's own within rounding (norm-wise)."""
        items = self._probe_items()
        if not items:
            return False
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        try:
            first = [int(x) for x in self.forward(items).argmax(-1)]
            dec = [StepItem([t], len(it.tokens), it.blocks) for t, it in zip(first, items)]
            rows = self._decode_rows(dec)
            ref = self.forward(dec)
            kref = torch.stack([self.cache.k[i][rows[2], :, rows[3]] for i in (0, -1)]).float()
            with torch.inference_mode():
                got = step(*rows, self.cache.k, self.cache.v, self.windows)
            kgot = torch.stack([self.cache.k[i][rows[2], :, rows[3]] for i in (0, -1)]).float()
            ok = all(float((a.float() - b.float()).norm()) <= tol * float(b.float().norm()) + 1e-6
                     for a, b in ((got, ref), (kgot, kref)))
            if not ok:
                log.warning("fused decode step disagrees with the model's forward; keeping transformers' forward")
            return ok
        except Exception as e:  # noqa: BLE001 - any failure means: not this model
            log.warning("fused decode step not usable for this model: %s", e)
            return False

    def _fit_blocks(self, wanted: int | None, fraction: float, gpu_util: float, max_batched: int) -> int:
        """The block pool's size. CUDA: what `gpu_util` of the whole device holds once the weights
        and the activations of the largest step (a profiled forward of `max_batched` tokens) are
        counted, as vLLM's gpu_memory_utilization. CPU: `fraction` of the available RAM (a pool
        too big would only fail later, when decoding first touches its pages), and by default no
        more than max_num_seqs sequences of max_model_len. A configured number caps both."""
        per_block = self.kv_bytes_per_token() * self.block_size
        if self.device.type == "cuda":
            fit = (int(torch.cuda.get_device_properties(self.device).total_memory * gpu_util)
                   - self._profile_peak(max_batched)) // per_block
        else:
            import psutil

            fit = int(psutil.virtual_memory().available * fraction) // per_block
            if wanted is None:
                wanted = -(-self.max_num_seqs * self.max_model_len // self.block_size)
        if fit < 1:
            raise ModelLoadError(f"no room for one KV block ({per_block} bytes) on {self.device}; "
                                 f"lower max_model_len or max_num_seqs")
        if wanted is not None and fit < wanted:
            log.warning("KV memory on %s holds %d blocks of %d tokens, not %d", self.device, fit,
                        self.block_size, wanted)
        return min(fit, wanted) if wanted is not None else fit

    def _profile_peak(self, tokens: int) -> int:
        """CUDA: the memory peak of the largest step (weights included)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward(tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def _profile_forward(self, tokens: int) -> torch.Tensor:
        """A forward of `tokens` prompt tokens (the step budget) through a temporary block pool
        just big enough for it, before the real pool exists; its logits (one row a sequence). A
        step may pack the budget from several prompts, each at most the context, so the budget
        goes in as many sequences of at most `max_model_len` tokens as it takes (a budget capped
        at the context profiled a 2k-token step where the engine ran 8k: issue #21's OOM)."""
        tokens, bs = max(2, tokens), self.block_size
        lens = [self.max_model_len] * (tokens // self.max_model_len)
        if tokens % self.max_model_len:
            lens.append(tokens % self.max_model_len)
        s = self.kv_shape
        tables, nb = [], 0
        for n in lens:
            tables.append(list(range(nb, nb + -(-n // bs))))
            nb += len(tables[-1])
        saved = getattr(self, "cache", None)
        self.cache = PagedKVCache(s.num_layers, nb, s.num_kv_heads, bs, s.head_dim, s.v_dim, self.dtype, self.device)
        try:
            return self.forward([StepItem([1] * n, 0, t) for n, t in zip(lens, tables)])
        finally:
            self.cache = saved

    @torch.inference_mode()
    def forward_empty_pool(self, tokens: int) -> torch.Tensor:
        """A forward of `tokens` prompt tokens (one sequence, at most the context) through the first
        blocks of the block pool, as a prompt's: only for a pool that holds nothing yet (the
        engine's measure at start); its logits."""
        n = max(2, min(tokens, self.max_model_len))
        return self.forward([StepItem([1] * n, 0, list(range(-(-n // self.block_size))))])

    # ---- KV of one sequence ------------------------------------------------------------
    def read_kv(self, blocks: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence (its block table) as [layers, kv_heads, tokens, dim] on the CPU."""
        s = self.kv_shape
        if num_tokens == 0:
            return (torch.empty((s.num_layers, s.num_kv_heads, 0, s.head_dim), dtype=s.dtype),
                    torch.empty((s.num_layers, s.num_kv_heads, 0, s.v_dim), dtype=s.dtype))
        idx = torch.tensor(blocks[:-(-num_tokens // self.block_size)], device=self.device)[None]
        k = torch.stack([gather(b, idx, num_tokens)[0] for b in self.cache.k]).cpu()
        v = torch.stack([gather(b, idx, num_tokens)[0] for b in self.cache.v]).cpu()
        return k, v

    def write_kv(self, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [layers, kv_heads, tokens, dim] in this cache's dtype, any device, into the blocks."""
        n = k.shape[2]
        if n == 0:
            return
        bs = self.block_size
        pos = torch.arange(n, device=self.device)
        blk = torch.tensor(blocks, device=self.device)[pos // bs]
        off = pos % bs
        for layer, (kb, vb) in enumerate(zip(self.cache.k, self.cache.v)):
            kb[blk, :, off] = k[layer].to(self.device, non_blocking=True).transpose(0, 1)
            vb[blk, :, off] = v[layer].to(self.device, non_blocking=True).transpose(0, 1)

    # ---- forward -----------------------------------------------------------------------
    def _masks(self, q_pos: torch.Tensor, kv_len: int):
        """Additive masks [rows, 1, q, kv_len] for query positions q_pos [rows, q] over the
        gathered keys (key index = position)."""
        j = torch.arange(kv_len, device=self.device)
        dist = q_pos[:, :, None] - j[None, None, :]  # query position - key position
        allowed = dist >= 0

        def to_mask(ok):
            m = torch.zeros(ok.shape, dtype=self.dtype, device=self.device)
            return m.masked_fill_(~ok, self._min)[:, None]

        full = to_mask(allowed)
        if self.layer_types and "sliding_attention" in self.layer_types:
            return {"full_attention": full, "sliding_attention": to_mask(allowed & (dist < self.sliding_window))}
        if self.layer_types is None and self.sliding_window:
            return to_mask(allowed & (dist < self.sliding_window))
        return full

    def _slots(self, items: list[StepItem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions and (block, row) of every new token, in item order (host lists,
        one copy each to the device)."""
        bs = self.block_size
        if all(len(it.tokens) == 1 for it in items):  # decode rows: one token each (the common step)
            pos = [it.start for it in items]
            rows = self._rows(items)
            if rows is not None:
                blk = self.block_array[rows, np.asarray(pos) // bs]
            else:
                blk = [it.blocks[p // bs] for it, p in zip(items, pos)]
            t = torch.from_numpy(np.array([[it.tokens[0] for it in items], pos, blk], dtype=np.int64)).to(self.device)
            return t[0], t[1], t[2], t[1] % bs
        ids, pos, blk, off = [], [], [], []
        for it in items:
            ids += it.tokens
            r = range(it.start, it.start + len(it.tokens))
            pos += r
            blk += [it.blocks[p // bs] for p in r]
            off += [p % bs for p in r]
        t = torch.tensor([ids, pos, blk, off], device=self.device)
        return t[0], t[1], t[2], t[3]

    def _rows(self, items: list[StepItem]) -> np.ndarray | None:
        """The items' rows of `block_array`, where every one has its row."""
        if self.block_array is None:
            return None
        rows = np.fromiter((it.row for it in items), dtype=np.int64, count=len(items))
        return rows if len(rows) and rows.min() >= 0 else None

    def _tables(self, items: list[StepItem], dtype=torch.long) -> torch.Tensor:
        """Block tables [rows, widest] (unused places 0), through numpy: one copy to the device;
        a gather from `block_array` where the items have rows there."""
        rows = self._rows(items)
        if rows is not None and all(it.is_decode for it in items):  # the blocks up to each row's token
            width = max(it.start for it in items) // self.block_size + 1
            return torch.from_numpy(self.block_array[rows, :width]).to(self.device, dtype)
        width = max(len(it.blocks) for it in items)
        arr = np.zeros((len(items), width), dtype=np.int64)
        for r, it in enumerate(items):
            arr[r, :len(it.blocks)] = it.blocks
        return torch.from_numpy(arr).to(self.device, dtype)

    def _decode_rows(self, items: list[StepItem]):
        """Decode rows for the fused step and the kernels: ids, positions, blocks, rows-in-block,
        block tables [rows, max_blocks] int32, context lengths [rows] int64. Where every row has
        its row in `block_array` (the engine's decode steps), one pass over the items and two
        gathers, one copy each to the device."""
        rows = self._rows(items)
        if rows is None:
            ids, pos, blk, off = self._slots(items)
            return ids, pos, blk, off, self._tables(items, torch.int32), pos + 1
        n = len(items)
        return self._decode_inputs(np.fromiter((it.tokens[0] for it in items), dtype=np.int64, count=n),
                                   np.fromiter((it.start for it in items), dtype=np.int64, count=n), rows)

    def _decode_inputs(self, ids: np.ndarray, pos: np.ndarray, rows: np.ndarray):
        """_decode_rows from arrays: each row's token id, position and row of `block_array` (in
        one call of the CPU kernels where built: the same figures)."""
        K = self.kernels
        if K is not None and hasattr(K, "decode_inputs"):
            got = K.decode_inputs(torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(rows),
                                  torch.from_numpy(self.block_array), self.block_size)
            return tuple(got)  # (the kernels are the CPU engine's: no copy to make)
        bs = self.block_size
        arr = np.empty((3, len(ids)), dtype=np.int64)
        arr[0], arr[1] = ids, pos
        arr[2] = self.block_array[rows, arr[1] // bs]
        tables = self.block_array[rows, :int(arr[1].max()) // bs + 1]  # the blocks up to each row's token
        t = torch.from_numpy(arr).to(self.device)
        pos = t[1]
        return t[0], pos, t[2], pos % bs, torch.from_numpy(tables).to(self.device, torch.int32), pos + 1

    @property
    def decodes_arrays(self) -> bool:
        """Whether `decode` runs a step of decode rows given as arrays: through the fused step,
        or the paged model's own forward (the gather mode takes StepItems)."""
        return self.block_array is not None and (self.fused_step is not None or self.paged)

    @property
    def decodes_ahead(self) -> bool:
        """Whether `decode` takes a step's token ids from the previous step's sampled ids on the
        device (`prev`): decode steps over the static buffers (asynchronous scheduling)."""
        return self.static_decode is not None and self.fused_step is None and self.block_array is not None

    @torch.inference_mode()
    def decode(self, ids: np.ndarray, pos: np.ndarray, rows: np.ndarray,
               prev: torch.Tensor | None = None) -> torch.Tensor:
        """A step of decode rows alone given as arrays (each row's token id, position, and row of
        `block_array`), through the fused step where it runs, else the paged model's forward
        (`decodes_arrays`): the engine's common step with no per-row object. Logits [rows, vocab]
        in row order. `prev` (`decodes_ahead`): the previous step's sampled ids on the device;
        `ids` are then the indices of each row's token among them."""
        sd = self.static_decode
        if sd is not None and self.fused_step is None and len(ids) <= sd.max_rows:
            return sd.run(sd.fill(ids, pos, rows, self.block_array, prev))[:len(ids)]
        assert prev is None, "a decode step from the device's sampled ids runs over the static buffers"
        inputs = self._decode_inputs(ids, pos, rows)
        if self.fused_step is not None:
            return self.fused_step(*inputs, self.cache.k, self.cache.v, self.windows)
        return self._step_decode(*inputs)

    def _step_decode(self, ids, pos, blk, off, tables, ctx) -> torch.Tensor:
        """The paged model's forward over decode rows given as device tensors (tables int32)."""
        b = StepBatch(ids[None], pos[None], blk, off, [], [], [], [], chunks=[], all_decode=True)
        b.dec_tables, b.dec_ctx = tables, ctx
        if self.attn.kernel == "torch":
            b.dec_tables_long = tables.long()
        return self._run_packed(b, 0)  # (0: every row's logits)

    def _static_step(self, ids, pos, blk, off, tables, ctx) -> torch.Tensor:
        """StaticDecode's step: the same forward, over its buffers (what a CUDA graph captures)."""
        with torch.inference_mode():
            return self._step_decode(ids, pos, blk, off, tables, ctx)

    @torch.inference_mode()
    def forward(self, items: list[StepItem], decode: bool = False) -> torch.Tensor:
        """One step's sequences; the logits each item asked for, in item order [rows, vocab].
        `decode`: the caller knows every item is a decode row (not looked at again)."""
        if self.fused_step is not None and (decode or all(it.is_decode for it in items)):
            return self.fused_step(*self._decode_rows(items), self.cache.k, self.cache.v, self.windows)
        if self.paged:
            return self._forward_packed(items)
        # the model's own attention: decode rows in one batch, each prompt chunk alone; item order kept
        dec = [it for it in items if it.is_decode]
        dec_logits = self._forward_gather(dec) if dec else None
        rows, di = [], 0
        for it in items:
            if it.is_decode:
                rows.append(dec_logits[di:di + 1])
                di += 1
            else:
                logits = self._forward_gather([it])
                if it.num_logits:
                    rows.append(logits)
        return torch.cat(rows) if rows else torch.empty((0, self.vocab_size), device=self.device)

    def _keep(self, items: list[StepItem]) -> torch.Tensor:
        if all(len(it.tokens) == 1 and it.logits == "last" for it in items):
            return torch.arange(len(items), device=self.device)
        keep, at = [], 0
        for it in items:
            n = len(it.tokens)
            keep += range(at + n - it.num_logits, at + n)
            at += n
        return torch.tensor(keep, dtype=torch.long, device=self.device)

    def _forward_packed(self, items: list[StepItem]) -> torch.Tensor:
        ids, pos, blk, off = self._slots(items)
        lens = [len(it.tokens) for it in items]
        decode = [it.is_decode for it in items]
        q_starts = list(itertools.accumulate(lens, initial=0))[:-1]
        chunks = [i for i, d in enumerate(decode) if not d]
        tables: list = [None] * len(items)
        for i in chunks:
            if items[i].start:
                tables[i] = torch.tensor(items[i].blocks, device=self.device)
        b = StepBatch(ids[None], pos[None], blk, off, q_starts, lens, [it.start for it in items], tables,
                      chunks=chunks)
        if not chunks:  # decode rows alone: packed index i is row i
            b.dec = torch.arange(len(items), device=self.device)
            b.dec_tables_long = self._tables(items)
            b.dec_ctx = pos + 1
        elif len(chunks) < len(items):
            dec = [it for it, d in zip(items, decode) if d]
            b.dec = torch.tensor([q for q, d in zip(q_starts, decode) if d], device=self.device)
            b.dec_tables_long = self._tables(dec)
            b.dec_ctx = torch.tensor([it.start + 1 for it in dec], device=self.device)
        if b.dec is not None:
            b.dec_tables = b.dec_tables_long.to(torch.int32)
        if chunks and self.attn.kernel == "triton":  # in one launch: all but long fresh prompts (flash SDPA's)
            kernel = [i for i in chunks if items[i].start or len(items[i].tokens) < FLASH_PROMPT_TOKENS]
            if kernel:
                b.kernel_chunks, b.chunks = kernel, [i for i in chunks if i not in kernel]
                b.chunk_tables, b.chunk_meta = self._tables([items[i] for i in kernel], torch.int32), {}
        return self._run_packed(b, self._keep(items))

    def _run_packed(self, b: StepBatch, keep) -> torch.Tensor:
        """The model's forward over a packed step (the paged attention reads `b`); the logits of
        the packed positions `keep` (an index tensor, or 0 for all)."""
        self.cache.batch = b
        try:
            with active(self.attn):
                out = self.model(input_ids=b.input_ids, position_ids=b.positions, use_cache=True,
                                 logits_to_keep=keep, **{self._cache_kw: self.cache})
        finally:
            self.cache.batch = None
        return out.logits[0]

    def _forward_gather(self, items: list[StepItem]) -> torch.Tensor:
        """The model's own attention (and masks) over keys gathered from the pool: decode rows in
        one batch, or one sequence's chunk."""
        ids, pos, blk, off = self._slots(items)
        rows = len(items)
        t = len(items[0].tokens)
        kv_len = max(it.start + len(it.tokens) for it in items)
        gi = self._tables(items)[:, :-(-kv_len // self.block_size)]
        self.cache.batch = StepBatch(ids.view(rows, t), pos.view(rows, t), blk, off, [], [], [], [], gather=True,
                                     gather_idx=gi, kv_len=kv_len)
        try:
            out = self.model(input_ids=ids.view(rows, t), position_ids=pos.view(rows, t),
                             attention_mask=self._masks(pos.view(rows, t), kv_len), use_cache=True,
                             logits_to_keep=0 if items[0].logits == "all" else 1, **{self._cache_kw: self.cache})
        finally:
            self.cache.batch = None
        lg = out.logits
        return lg[0] if items[0].logits == "all" else lg[:, -1]

    # ---- device facts ------------------------------------------------------------------
    @property
    def kernels(self):
        """The compiled CPU kernels this CPU engine uses (None: plain torch, or not on CPU)."""
        return self._kernels

    def kv_bytes_per_token(self) -> int:
        s = self.kv_shape
        return s.num_layers * s.num_kv_heads * (s.head_dim + s.v_dim) * torch.finfo(s.dtype).bits // 8

    def device_label(self) -> str:
        if self.device.type == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.device)}"
        return f"cpu ({os.cpu_count()} cores visible, torch threads {torch.get_num_threads()})"
