"""Attention over the paged KV pool as Triton kernels (the GPU's; issue #21): decode rows, and a
step's prompt chunks in one launch.

One program per (sequence, KV head): it loads the query heads of that KV head's group (grouped
query attention without repeating K or V), walks the sequence's keys through its block table in
tiles of `BLOCK_N` tokens up to the sequence's own length (a batch of mixed lengths: nothing padded
to the longest, a table wider than the sequence costs nothing), with an online softmax, and writes
the group's outputs. Sliding windows start the walk at the window. Where rows x KV heads are too
few programs to hide the device's memory latency (under 8 a multiprocessor: on an H200 batch 1
ran at 35 µs per layer for 1k keys, 64 sequences at 2.9 of its 4 TB/s), each (sequence, KV
head)'s keys are split over up to 16 programs, whose partial softmax states a second launch
combines (flash-decoding; `decode_splits`). Shapes are the block pool's
(`[blocks, kv_heads, block_size, dim]`, any block size) and the runner's decode rows (`qd` as
`[rows, heads, 1, dim]`, out `[rows, 1, heads, dim]`), the contract of `reference_decode`.

Prompt chunks (`paged_prefill`): one program per (tile of query tokens of one chunk, KV head), the
tile's tokens x the group's heads as the rows of one product against the chunk's keys read through
its block table (its cached blocks and its own new keys, written into the pool before attention),
causal, windowed: every chunk of a step, fresh prompt or continuation over a cached prefix, in one
launch per layer instead of a gather, a mask and an SDPA call per chunk.

Triton is imported and the kernel jitted when first wanted (never on a CPU replica); a box without
`triton` imports this module fine and `available()` says no. Under
`TRITON_INTERPRET=1` the same kernel runs on CPU tensors through Triton's interpreter (float32 and
float16: numpy has no bfloat16), which is how the tests check it on a machine without a GPU.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

BLOCK_N = 64  # keys per tile
_kernel = None  # (interpret flag, the jitted kernel)
_reason = ""
tl = None  # triton.language once imported: the kernel's body names it as a module global (Triton's
# interpreter patches those); imported when first wanted, so CPU replicas never pay for it


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _attend_tile_py(q, K, V, T, j, jm, ok, kvh, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, scale, m_i, l_i, acc,
                    D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BS: tl.constexpr,
                    IEEE: tl.constexpr):
    """Both kernels' step over one tile of keys j (jm: which exist; ok [rows, keys]: which each query
    row sees), read through the block table row T: scores, the online softmax, the values."""
    d = tl.arange(0, DP)
    dv = tl.arange(0, DVP)
    blk = tl.load(T + j // BS, mask=jm, other=0).to(tl.int64)
    row = (j % BS).to(tl.int64)
    k = tl.load(K + blk[:, None] * sk_n + kvh * sk_h + row[:, None] * sk_t + d[None, :],
                mask=jm[:, None] & (d[None, :] < D), other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(ok, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet (padding)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + blk[:, None] * sv_n + kvh * sv_h + row[:, None] * sv_t + dv[None, :],
                mask=jm[:, None] & (dv[None, :] < DV), other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


_attend_tile = None  # _attend_tile_py jitted (by _build), as the kernels call it


def _paged_decode(Q, K, V, T, C, O, PM, PL, PA, sq_b, sq_h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, st_b, so_b, so_h,
                  scale, window, S: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                  IEEE: tl.constexpr):
    """One (sequence, KV head, split): the group's query heads over the split's share of the
    sequence's keys (its length cut into S runs of whole tiles; S = 1: all of them). S = 1 writes
    the group's outputs into O; above, the partial softmax state (max, sum, weighted values) into
    PM / PL / PA [rows, kvh, S, GP(, DVP)], which `_combine` merges (module docstring)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(C + b).to(tl.int32)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    dv = tl.arange(0, DVP)
    gm = g < G
    heads = kvh * G + g
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gm[:, None] & (d[None, :] < D),
                other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DVP], tl.float32)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    first = (lo // BN) * BN
    per = ((ctx - first + BN - 1) // BN + S - 1) // S  # tiles per split
    seg_lo = first + sp * per * BN
    seg_hi = tl.minimum(seg_lo + per * BN, ctx)
    for start in range(seg_lo, seg_hi, BN):
        j = start + tl.arange(0, BN)
        jm = (j >= lo) & (j < seg_hi)
        m_i, l_i, acc = _attend_tile(q, K, V, T + b * st_b, j, jm, jm[None, :], kvh, sk_n, sk_h, sk_t, sv_n, sv_h,
                                     sv_t, scale, m_i, l_i, acc, D, DP, DV, DVP, BS, IEEE)
    if S == 1:
        out = acc / l_i[:, None]
        tl.store(O + b * so_b + heads[:, None] * so_h + dv[None, :], out.to(O.dtype.element_ty),
                 mask=gm[:, None] & (dv[None, :] < DV))
    else:
        part = (b * tl.num_programs(1) + kvh) * S + sp
        tl.store(PM + part * GP + g, m_i, mask=gm)  # (the group's rows only: GP pads it to 16)
        tl.store(PL + part * GP + g, l_i, mask=gm)
        tl.store(PA + (part * GP + g)[:, None] * DVP + dv[None, :], acc, mask=gm[:, None])


def _combine(PM, PL, PA, O, so_b, so_h, S: tl.constexpr, SP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
             DV: tl.constexpr, DVP: tl.constexpr):
    """One (sequence, KV head): its S partial softmax states merged, the group's outputs written."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    base = (b * tl.num_programs(1) + kvh) * S
    s = tl.arange(0, SP)
    g = tl.arange(0, GP)
    dv = tl.arange(0, DVP)
    sm = s < S
    idx = (base + s)[:, None] * GP + g[None, :]  # [SP, GP]
    gm = g < G
    m = tl.load(PM + idx, mask=sm[:, None] & gm[None, :], other=float("-inf"))
    l = tl.load(PL + idx, mask=sm[:, None] & gm[None, :], other=0.0)
    mx = tl.max(m, 0)  # [GP]: every row of the group saw at least one key in some split
    mx = tl.where(gm, mx, 0.0)  # (padding rows: all -inf, kept finite)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx[None, :]))  # [SP, GP]
    total = tl.sum(l * w, 0)
    total = tl.where(gm, total, 1.0)
    acc = tl.zeros([GP, DVP], tl.float32)
    for k in range(S):
        wk = tl.sum(tl.where(s[:, None] == k, w, 0.0), 0)  # [GP]: split k's weight
        a = tl.load(PA + ((base + k) * GP + g)[:, None] * DVP + dv[None, :], mask=gm[:, None], other=0.0)
        acc += a * wk[:, None]
    out = acc / total[:, None]
    heads = kvh * G + g
    tl.store(O + b * so_b + heads[:, None] * so_h + dv[None, :], out.to(O.dtype.element_ty),
             mask=(g < G)[:, None] & (dv[None, :] < DV))


def _paged_prefill(Q, K, V, T, TC, TM, QS, QL, ST, O, sq_t, sq_h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, st_c,
                   so_t, so_h, scale, window, G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr,
                   D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BS: tl.constexpr,
                   BN: tl.constexpr, IEEE: tl.constexpr):
    """One (tile of BM query tokens of one prompt chunk, KV head): the group's heads for those tokens
    as BM x GP rows against the chunk's keys through its block table, causal, windowed."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    c = tl.load(TC + tile)  # the chunk
    m0 = tl.load(TM + tile)  # its first token in this tile
    qs = tl.load(QS + c)  # where the chunk's tokens sit in the packed row
    ql = tl.load(QL + c)
    start = tl.load(ST + c)  # tokens cached before the chunk
    r = tl.arange(0, BM * GP)
    m = m0 + r // GP  # the row's token within the chunk
    g = r % GP
    rm = (m < ql) & (g < G)
    pos = start + m  # its position: it sees keys 0..pos
    head = kvh * G + g
    d = tl.arange(0, DP)
    dv = tl.arange(0, DVP)
    q = tl.load(Q + (qs + m)[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                mask=rm[:, None] & (d[None, :] < D), other=0.0)
    m_i = tl.full([BM * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BM * GP], tl.float32)
    acc = tl.zeros([BM * GP, DVP], tl.float32)
    hi = start + tl.minimum(m0 + BM, ql)  # keys the tile's last token sees
    lo = tl.where(window > 0, tl.maximum(start + m0 - window + 1, 0), 0)
    for j0 in range((lo // BN) * BN, hi, BN):
        j = j0 + tl.arange(0, BN)
        jm = j < hi
        ok = jm[None, :] & (j[None, :] <= pos[:, None])
        ok = ok & ((window == 0) | (pos[:, None] - j[None, :] < window))
        m_i, l_i, acc = _attend_tile(q, K, V, T + c * st_c, j, jm, ok, kvh, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t,
                                     scale, m_i, l_i, acc, D, DP, DV, DVP, BS, IEEE)
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
    tl.store(O + (qs + m)[:, None] * so_t + head[:, None] * so_h + dv[None, :], out.to(O.dtype.element_ty),
             mask=rm[:, None] & (dv[None, :] < DV))


def _write_kv(K, V, KP, VP, BLK, OFF, sk_h, sk_t, sv_h, sv_t, skp_n, skp_h, skp_t, svp_n, svp_h, svp_t,
              D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(BLK + t).to(tl.int64)
    off = tl.load(OFF + t).to(tl.int64)
    d = tl.arange(0, DP)
    x = tl.load(K + h * sk_h + t * sk_t + d, mask=d < D)
    tl.store(KP + blk * skp_n + h * skp_h + off * skp_t + d, x, mask=d < D)
    dv = tl.arange(0, DVP)
    y = tl.load(V + h * sv_h + t * sv_t + dv, mask=dv < DV)
    tl.store(VP + blk * svp_n + h * svp_h + off * svp_t + dv, y, mask=dv < DV)


def write_kv(key: torch.Tensor, value: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, blk: torch.Tensor,
             off: torch.Tensor) -> bool:
    """A step's new keys and values into the layer's pools in one launch: key / value [1, kv_heads,
    tokens, dim] (the attention layer's, any strides with the last 1), token i to block blk[i] at
    offset off[i]. The torch way is a transposed copy and an indexed write for each (four kernels a
    layer: at batch 1 each is a few microseconds of a step that is mostly launches). False (nothing
    written) for a layout it does not take."""
    if (key.dim() != 4 or key.shape[0] != 1 or key.stride(-1) != 1 or value.stride(-1) != 1
            or kp.stride(-1) != 1 or vp.stride(-1) != 1 or key.dtype != kp.dtype or value.dtype != vp.dtype):
        return False
    tokens, heads = key.shape[2], key.shape[1]
    if tokens:
        dim, dv = key.shape[-1], value.shape[-1]
        _build()["write_kv"][(tokens, heads)](key, value, kp, vp, blk, off, key.stride(1), key.stride(2),
                                               value.stride(1), value.stride(2), kp.stride(0), kp.stride(1),
                                               kp.stride(2), vp.stride(0), vp.stride(1), vp.stride(2),
                                               D=dim, DP=_pow2(dim), DV=dv, DVP=_pow2(dv))
    return True


def _build():
    """The jitted kernels {name: kernel}, built on first use (and again if the interpreter flag changed)."""
    global _kernel, _reason, tl
    flag = interpreting()
    if _kernel is not None and _kernel[0] == flag:
        return _kernel[1]
    try:
        import triton
        import triton.language
    except Exception as e:  # noqa: BLE001 - no triton: the torch reference attends
        _reason = f"triton not importable: {type(e).__name__}: {e}"
        return None
    tl = triton.language
    global _attend_tile
    _attend_tile = triton.jit(_attend_tile_py)
    _kernel = (flag, {"decode": triton.jit(_paged_decode), "prefill": triton.jit(_paged_prefill),
                      "combine": triton.jit(_combine), "write_kv": triton.jit(_write_kv)})
    return _kernel[1]


def lazy_jit(fn):
    """A Triton kernel jitted when first wanted (again if the interpreter flag changed), its
    module's global `tl` set to triton.language then: `lazy_jit(f)()` is the jitted kernel. (The
    other GPU kernels' modules use it; a CPU replica never imports triton.)"""
    cache: dict = {}

    def get():
        flag = interpreting()
        if flag not in cache:
            import triton
            import triton.language

            fn.__globals__["tl"] = triton.language
            cache.clear()
            cache[flag] = triton.jit(fn)
        return cache[flag]

    return get


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device`: CUDA with triton, or any device under the interpreter."""
    if device.type != "cuda" and not interpreting():
        return False
    return _build() is not None


def unavailable_reason() -> str:
    return _reason


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


PREFILL_ROWS = 64  # query rows per prefill program: tokens x the group's heads (padded to a power of 2)
PREFILL_BN = 32  # keys per tile in prefill


def paged_prefill(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, tables: torch.Tensor, q_starts: list[int],
                  q_lens: list[int], starts: list[int], window: int, scale: float, out: torch.Tensor,
                  meta: dict) -> None:
    """The attention of a step's prompt chunks, all in one launch: q [T, H, D] (the packed row's
    tokens; chunk i's at q_starts[i]..+q_lens[i], after starts[i] tokens it has cached), its keys
    and values already written into the pool, read through tables [chunks, width] (int32), causal,
    windowed; the chunks' rows of out [T, H, Dv] written. `meta`: a dict kept for the step (the
    programs' tile list, sent to the device once for all the layers)."""
    kernel = _build()["prefill"]
    heads, dim = q.shape[1], q.shape[2]
    kvh, bs, dv = kp.shape[1], kp.shape[2], vp.shape[-1]
    group = heads // kvh
    gp = _pow2(group, 1)
    bm = max(1, PREFILL_ROWS // gp)
    if "tiles" not in meta or meta["bm"] != bm:
        tc, tm = [], []
        for c, n in enumerate(q_lens):
            for m0 in range(0, n, bm):
                tc.append(c)
                tm.append(m0)
        meta["bm"] = bm
        meta["n"] = len(tc)
        meta["tiles"] = torch.tensor([tc, tm], dtype=torch.int32).to(q.device, non_blocking=True)
        meta["chunks"] = torch.tensor([q_starts, q_lens, starts], dtype=torch.int32).to(q.device, non_blocking=True)
    tiles, chunks = meta["tiles"], meta["chunks"]
    assert kp.stride(-1) == 1 and vp.stride(-1) == 1 and q.stride(-1) == 1 and tables.stride(-1) == 1
    kernel[(meta["n"], kvh)](q, kp, vp, tables, tiles[0], tiles[1], chunks[0], chunks[1], chunks[2], out,
                             q.stride(0), q.stride(1), kp.stride(0), kp.stride(1), kp.stride(2), vp.stride(0),
                             vp.stride(1), vp.stride(2), tables.stride(0), out.stride(0), out.stride(1),
                             float(scale), int(window or 0), G=group, GP=gp, BM=bm, D=dim, DP=_pow2(dim),
                             DV=dv, DVP=_pow2(dv), BS=bs, BN=PREFILL_BN, IEEE=q.dtype == torch.float32)


MAX_SPLITS = 16  # key splits per (sequence, KV head) at most
PROGRAMS_PER_SM = 8  # decode programs a multiprocessor gets at least, where splitting the keys can give them
_sms: dict = {}  # device index -> its multiprocessor count


def decode_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """How many programs share one (sequence, KV head)'s keys: enough for PROGRAMS_PER_SM programs
    per multiprocessor, a power of two, 1 once the batch alone has that many. Too few programs
    leave the device's memory latency unhidden: on the H200 a batch-1 step of a model with 8 KV
    heads (8 programs walking every key alone) ran at 35 µs per layer for 1k keys; 512 programs
    (64 sequences x 8 KV heads, 3.9 per multiprocessor) read the keys at 2.9 TB/s, 2048 (256
    sequences) at 3.95. Fixed per bucket (a CUDA graph's grid is), whatever the rows' lengths: a
    split past a row's keys has nothing to do. Under the interpreter: as an 8-SM device."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _sms:
            _sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        sms = _sms[idx]
    else:
        sms = 8
    want = -(-PROGRAMS_PER_SM * sms // max(1, rows * kv_heads))
    return min(MAX_SPLITS, 1 << (want - 1).bit_length()) if want > 1 else 1


def paged_decode(qd: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                 window: int, scale: float, splits: int | None = None) -> torch.Tensor:
    """Decode attention: qd [rows, H, 1, D]; kp / vp the layer's pools [blocks, KVH, block_size, D(v)];
    tables [rows, width] (int32 or int64, entries past a row's length unread); ctx [rows] the keys each
    row attends over (at least 1). Returns [rows, 1, H, Dv] in qd's dtype. No host sync: capturable.
    `splits`: programs per (row, KV head) (None: `decode_splits`); above 1, each writes a partial
    softmax state and a second launch combines them (flash-decoding)."""
    k = _build()
    rows, heads, _, dim = qd.shape
    kvh, bs, dv = kp.shape[1], kp.shape[2], vp.shape[-1]
    group = heads // kvh
    q = qd[:, :, 0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert kp.stride(-1) == 1 and vp.stride(-1) == 1 and tables.stride(-1) == 1
    out = torch.empty((rows, 1, heads, dv), dtype=qd.dtype, device=qd.device)
    o = out[:, 0]
    gp, dvp = _pow2(group), _pow2(dv)
    splits = decode_splits(rows, kvh, qd.device) if splits is None else max(1, splits)
    if splits > 1:  # the partial states, combined by a second launch
        pm = torch.empty((rows, kvh, splits, gp), dtype=torch.float32, device=qd.device)
        pl = torch.empty_like(pm)
        pa = torch.empty((rows, kvh, splits, gp, dvp), dtype=torch.float32, device=qd.device)
    else:
        pm = pl = pa = o  # (unused)
    k["decode"][(rows, kvh, splits)](q, kp, vp, tables, ctx, o, pm, pl, pa, q.stride(0), q.stride(1), kp.stride(0),
                                     kp.stride(1), kp.stride(2), vp.stride(0), vp.stride(1), vp.stride(2),
                                     tables.stride(0), o.stride(0), o.stride(1), float(scale), int(window or 0),
                                     S=splits, G=group, GP=gp, D=dim, DP=_pow2(dim), DV=dv, DVP=dvp, BS=bs, BN=BLOCK_N,
                                     IEEE=qd.dtype == torch.float32)
    if splits > 1:
        k["combine"][(rows, kvh)](pm, pl, pa, o, o.stride(0), o.stride(1), S=splits, SP=_pow2(splits, 2), G=group,
                                  GP=gp, DV=dv, DVP=dvp)
    return out


def self_check(device: torch.device, dtype: torch.dtype, kv_heads: int, heads: int, dim: int, v_dim: int,
               block_size: int) -> bool:
    """The kernel against the torch reference on random data of a pool's shapes (a batch of mixed
    lengths, one with a window; one program per row and keys split), on `device`: what the runner
    checks before choosing it."""
    from keyacc_ray.engine.paged_attention import reference_decode

    if heads % kv_heads:
        return False
    g = torch.Generator(device="cpu").manual_seed(5)
    nb, rows = 24, 4
    kp = torch.randn((nb, kv_heads, block_size, dim), generator=g).to(device, dtype)
    vp = torch.randn((nb, kv_heads, block_size, v_dim), generator=g).to(device, dtype)
    qd = torch.randn((rows, heads, 1, dim), generator=g).to(device, dtype)
    width = nb // 2
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in range(rows)]).to(device, torch.int32)
    ctx = torch.tensor([1, block_size + 3, width * block_size, 5], device=device)
    scale = dim ** -0.5
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for window in (0, block_size + 1):
        ref = reference_decode(qd.float(), kp.float(), vp.float(), tables.long(), ctx, window, scale)
        for splits in {1, decode_splits(1, kv_heads, device)}:  # one program per row, and the most splits
            got = paged_decode(qd, kp, vp, tables, ctx, window, scale, splits).float()
            if not float((got - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max())):
                return False
    return True
