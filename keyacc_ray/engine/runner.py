"""The model forward on one device: every torch / CUDA detail of the engine lives here.

Any transformers decoder-only model runs unmodified. Its attention layers only call
`cache.update(key, value, layer_idx)` and attend over what it returns, so `SlotKVCache` hands
them views of a preallocated buffer per layer, `[slots, kv_heads, max_len, head_dim]`, and we
pass a ready 4D additive mask (transformers uses a prepared 4D mask as it is) plus explicit
per-row positions. Running sequences occupy slots 0..n-1 (a freed slot is refilled by moving
the last one), so the batched decode attends over plain views: no gather copy, no `torch.cat`.
"""
from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass

import torch

from keyacc_ray.errors import ModelLoadError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


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


class SlotKVCache:
    """Duck-typed transformers cache over preallocated per-layer slot buffers."""

    is_compileable = False

    def __init__(self, shape: KVShape, num_slots: int, max_len: int, device: torch.device):
        kdims = (num_slots, shape.num_kv_heads, max_len, shape.head_dim)
        vdims = (num_slots, shape.num_kv_heads, max_len, shape.v_dim)
        self.k = [torch.zeros(kdims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(vdims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self._mode = None

    # Set by the runner before each forward.
    def bind_decode(self, rows: int, positions: torch.Tensor, kv_len: int) -> None:
        self._mode = ("decode", rows, positions, torch.arange(rows, device=positions.device), kv_len)

    def bind_extend(self, slot: int, start: int, kv_len: int) -> None:
        self._mode = ("extend", slot, start, None, kv_len)

    def bind_prefill(self, slots: list[int], offsets: list[int], width: int, device: torch.device) -> None:
        """Fresh prompts, left-padded to `width`: row r's tokens are columns offsets[r].. of the
        batch. Every real token's (row, column) -> (slot, position), for one gather and one write
        per layer (not one copy per row: on a GPU each is a kernel launch)."""
        rows, cols, dst_slots, positions = [], [], [], []
        for r, (slot, off) in enumerate(zip(slots, offsets)):
            n = width - off
            rows += [r] * n
            cols += range(off, width)
            dst_slots += [slot] * n
            positions += range(n)
        idx = torch.tensor([rows, cols, dst_slots, positions], device=device)
        self._mode = ("prefill", idx, None, None, None)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kind, a, b, rows_idx, kv_len = self._mode
        k, v = self.k[layer_idx], self.v[layer_idx]
        if kind == "prefill":  # a = [rows, cols, slots, positions]; nothing cached before: attend over these
            rows, cols, slots, positions = a
            k[slots, :, positions] = key_states[rows, :, cols]
            v[slots, :, positions] = value_states[rows, :, cols]
            return key_states, value_states
        if kind == "decode":  # a = rows, b = positions [rows]
            k[rows_idx, :, b, :] = key_states[:, :, 0, :]
            v[rows_idx, :, b, :] = value_states[:, :, 0, :]
            return k[:a, :, :kv_len], v[:a, :, :kv_len]
        t = key_states.shape[2]  # extend: a = slot, b = start position
        k[a, :, b:b + t] = key_states[0]
        v[a, :, b:b + t] = value_states[0]
        return k[a:a + 1, :, :kv_len], v[a:a + 1, :, :kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


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


class ModelRunner:
    def __init__(self, model: str, dtype: str, device: str, num_slots: int, max_model_len: int | None,
                 num_threads: int | None = None, kv_memory_fraction: float = 0.85, cpu_kernels: str = "off",
                 cpu_weight_quant: str = "none", trust_remote_code: bool = False):
        from transformers import AutoConfig

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
        self._cache_kw = cache_kwarg(self.model)
        cfg = self.model.config
        self.hf_config = cfg
        self.dtype = torch_dtype
        self.vocab_size = cfg.vocab_size
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
        self.max_model_len = min(max_model_len or limit, limit)
        self.layer_types = getattr(cfg, "layer_types", None)
        self.sliding_window = getattr(cfg, "sliding_window", None)
        self._min = torch.finfo(torch_dtype).min
        self.kv_shape = self._probe_kv_shape()
        self.num_slots = self._fit_slots(num_slots, kv_memory_fraction)
        self.cache = SlotKVCache(self.kv_shape, self.num_slots, self.max_model_len, self.device)
        self._slot_of: dict[str, int] = {}
        self._owner: list[str | None] = [None] * self.num_slots
        self.fast_path = None  # what keyacc_ray.kernels swapped in (FastPathReport)
        self.fused_step = None  # FusedDecodeStep once it reproduced the model's own logits
        self._check_cache_used()
        if self.device.type == "cpu" and cpu_kernels != "off":
            self._enable_cpu_kernels(required=cpu_kernels == "on",
                                     quant=None if cpu_weight_quant == "none" else cpu_weight_quant)

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

    def _check_cache_used(self) -> None:
        """One 2-token forward into a probe slot must write its keys: a model (or transformers
        version) that takes the cache under another name would otherwise attend over the current
        token alone and produce fluent garbage with no error."""
        rid = "__keyacc_cache_probe__"
        slot = self.alloc_slot(rid)
        try:
            for buf in self.cache.k:  # a slot keeps what its last sequence left
                buf[slot, :, :2].zero_()
            self.extend(rid, [1, 2], 0)
            written = bool(self.cache.k[0][slot, :, :2].abs().sum() > 0)
        finally:
            self.free_slot(rid)
        if not written:
            raise ModelLoadError(f"{type(self.model).__name__} did not write the KV cache passed as "
                                 f"{self._cache_kw!r}; this transformers version or model is not supported",
                                 param="model")

    # ---- CPU fast path -----------------------------------------------------------------
    def _enable_cpu_kernels(self, required: bool, quant: str | None) -> None:
        from keyacc_ray import kernels

        mod = kernels.load()
        if mod is None:
            if required:
                raise ModelLoadError(f"cpu_kernels=on but the kernels did not build: {kernels.unavailable_reason()}")
            return
        from keyacc_ray.kernels import fastpath
        from keyacc_ray.kernels.fused_step import FusedDecodeStep

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
        g = torch.Generator().manual_seed(7)
        lens = [5, 9][: max(1, min(2, self.num_slots))]
        ids = [f"__probe{i}" for i in range(len(lens))]
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        try:
            first = []
            for rid, n in zip(ids, lens):
                self.alloc_slot(rid)
                prompt = torch.randint(0, self.vocab_size, (n,), generator=g).tolist()
                first.append(int(self.extend(rid, prompt, 0).argmax()))
            pos = torch.tensor(lens, device=self.device)
            ref = self.decode(first, lens)
            kref = torch.stack([self.cache.k[i][torch.arange(len(lens)), :, pos] for i in (0, -1)]).float()
            with torch.inference_mode():
                got = step(torch.tensor(first, device=self.device), pos, self._masks(pos[:, None], max(lens) + 1),
                           self.cache.k, self.cache.v, max(lens) + 1)
            kgot = torch.stack([self.cache.k[i][torch.arange(len(lens)), :, pos] for i in (0, -1)]).float()
            ok = all(float((a.float() - b.float()).norm()) <= tol * float(b.float().norm()) + 1e-6
                     for a, b in ((got, ref), (kgot, kref)))
            if not ok:
                log.warning("fused decode step disagrees with the model's forward; keeping transformers' forward")
            return ok
        except Exception as e:  # noqa: BLE001 - any failure means: not this model
            log.warning("fused decode step not usable for this model: %s", e)
            return False
        finally:
            for rid in ids:
                if rid in self._slot_of:
                    self.free_slot(rid)

    def _fit_slots(self, wanted: int, fraction: float) -> int:
        """The KV buffer is sized from the free memory after the weights: as many slots (up to
        `wanted`) as `fraction` of it holds: free device memory on CUDA, available RAM on CPU
        (where a buffer too big would only fail later, when decoding first touches its pages)."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            import psutil

            free = psutil.virtual_memory().available
        per_slot = self.kv_bytes_per_token() * self.max_model_len
        fit = int(free * fraction) // per_slot
        if fit < 1:
            raise ModelLoadError(f"no room for even one sequence of {self.max_model_len} tokens of KV on "
                                 f"{self.device} ({free / 2**30:.1f} GiB free); lower max_model_len")
        if fit < wanted:
            log.warning("KV memory on %s holds %d sequences of %d tokens, not %d", self.device, fit,
                        self.max_model_len, wanted)
        return min(wanted, fit)

    # ---- slots -------------------------------------------------------------------------
    @property
    def num_used_slots(self) -> int:
        return len(self._slot_of)

    def slot_of(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def alloc_slot(self, request_id: str) -> int:
        slot = len(self._slot_of)
        assert slot < self.num_slots, "no free KV slot: the scheduler admitted too many"
        self._slot_of[request_id] = slot
        self._owner[slot] = request_id
        return slot

    def free_slot(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id)
        last = len(self._slot_of)  # index of the last used slot before the pop
        if slot != last:
            moved = self._owner[last]
            for buf in (*self.cache.k, *self.cache.v):
                buf[slot].copy_(buf[last])
            self._slot_of[moved] = slot
            self._owner[slot] = moved
        self._owner[last] = None

    def read_kv(self, request_id: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence as [layers, kv_heads, tokens, head_dim] on the CPU."""
        if num_tokens == 0:
            s = self.kv_shape
            return (torch.empty((s.num_layers, s.num_kv_heads, 0, s.head_dim), dtype=s.dtype),
                    torch.empty((s.num_layers, s.num_kv_heads, 0, s.v_dim), dtype=s.dtype))
        s = self._slot_of[request_id]
        k = torch.stack([b[s, :, :num_tokens] for b in self.cache.k]).cpu()
        v = torch.stack([b[s, :, :num_tokens] for b in self.cache.v]).cpu()
        return k, v

    def write_kv(self, request_id: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [layers, kv_heads, tokens, head_dim] in this cache's dtype, any device."""
        s = self._slot_of[request_id]
        n = k.shape[2]
        for layer, (kb, vb) in enumerate(zip(self.cache.k, self.cache.v)):
            kb[s, :, :n].copy_(k[layer], non_blocking=True)
            vb[s, :, :n].copy_(v[layer], non_blocking=True)

    # ---- forward -----------------------------------------------------------------------
    def _masks(self, q_pos: torch.Tensor, kv_len: int):
        """Additive masks [rows, 1, q, kv_len] for query positions q_pos [rows, q] over the
        cache (key index = position)."""
        j = torch.arange(kv_len, device=self.device)
        dist = q_pos[:, :, None] - j[None, None, :]  # query position - key position
        return self._to_masks(dist >= 0, dist)

    def _to_masks(self, allowed: torch.Tensor, dist: torch.Tensor):
        """Additive mask(s) [rows, 1, q, k] from `allowed` [rows, q, k]; sliding-window layers
        also need dist (query position - key position) < window."""
        def to_mask(ok):
            m = torch.zeros(ok.shape, dtype=self.dtype, device=self.device)
            return m.masked_fill_(~ok, self._min)[:, None]

        full = to_mask(allowed)
        if self.layer_types and "sliding_attention" in self.layer_types:
            return {"full_attention": full, "sliding_attention": to_mask(allowed & (dist < self.sliding_window))}
        if self.layer_types is None and self.sliding_window:
            return to_mask(allowed & (dist < self.sliding_window))
        return full

    @torch.inference_mode()
    def prefill(self, request_ids: list[str], prompts: list[list[int]]) -> torch.Tensor:
        """Fresh sequences (nothing cached) in one forward; logits of each one's last token
        [rows, vocab]. Left-padded, so every row's last token is the batch's last column
        (`logits_to_keep=1` holds for all); padding is masked out of every real row and never
        written to the cache."""
        width = max(len(p) for p in prompts)
        offsets = [width - len(p) for p in prompts]
        ids = torch.tensor([[0] * o + p for o, p in zip(offsets, prompts)], device=self.device)
        col = torch.arange(width, device=self.device)
        off = torch.tensor(offsets, device=self.device)[:, None, None]
        c, j = col[None, :, None], col[None, None, :]
        real = (j >= off) & (j <= c)
        # a padding query attends to itself alone: finite garbage nobody reads, not a NaN row
        allowed = real | ((c < off) & (j == c))
        pos = (col[None, :] - off[:, :, 0]).clamp_(min=0)
        self.cache.bind_prefill([self._slot_of[r] for r in request_ids], offsets, width, self.device)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=self._to_masks(allowed, c - j),
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: self.cache})
        return out.logits[:, -1]

    @torch.inference_mode()
    def extend(self, request_id: str, token_ids: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Feed `token_ids` at positions start.. into the sequence's slot; logits of the last
        [vocab], or of every position [len(token_ids), vocab] (`all_logits`: scoring a prompt)."""
        slot = self._slot_of[request_id]
        t = len(token_ids)
        pos = torch.arange(start, start + t, device=self.device)[None]
        self.cache.bind_extend(slot, start, start + t)
        out = self.model(input_ids=torch.tensor([token_ids], device=self.device), position_ids=pos,
                         attention_mask=self._masks(pos, start + t), use_cache=True,
                         logits_to_keep=0 if all_logits else 1, **{self._cache_kw: self.cache})
        return out.logits[0] if all_logits else out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One batched step for slots 0..len-1 (in slot order); logits [rows, vocab]."""
        rows = len(token_ids)
        assert rows <= self.num_used_slots
        pos = torch.tensor(positions, device=self.device)
        kv_len = max(positions) + 1
        if self.fused_step is not None:
            return self.fused_step(torch.tensor(token_ids, device=self.device), pos, self._masks(pos[:, None], kv_len),
                                   self.cache.k, self.cache.v, kv_len)
        self.cache.bind_decode(rows, pos, kv_len)
        out = self.model(input_ids=torch.tensor(token_ids, device=self.device)[:, None],
                         position_ids=pos[:, None], attention_mask=self._masks(pos[:, None], kv_len),
                         use_cache=True, **{self._cache_kw: self.cache})
        return out.logits[:, -1]

    # ---- device facts ------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        s = self.kv_shape
        return s.num_layers * s.num_kv_heads * (s.head_dim + s.v_dim) * torch.finfo(s.dtype).bits // 8

    def device_label(self) -> str:
        if self.device.type == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.device)}"
        return f"cpu ({os.cpu_count()} cores visible, torch threads {torch.get_num_threads()})"
