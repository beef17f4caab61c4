"""The C++ CPU kernels against torch / transformers references, on the kernel variant this CPU
runs; `test_portable_fallback` and `test_avx2_path` rerun this file and the sampling kernel's
tests (test_sampling.py) with KEYACC_CPU_ISA=portable / avx2 (the code a CPU without AVX-512
takes)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from keyacc_ray import kernels
from tests.conftest import ROOT

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def K():
    mod = kernels.load()
    assert mod is not None, f"kernels failed to build: {kernels.unavailable_reason()}"
    if os.environ.get("KEYACC_CPU_ISA") in ("portable", "avx2"):
        assert mod.isa() == os.environ["KEYACC_CPU_ISA"]
        assert mod.sampling_isa() == os.environ["KEYACC_CPU_ISA"]
    return mod


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n,k", [(64, 32), (70, 37), (300, 256), (1024, 96)])
@pytest.mark.parametrize("m", [1, 4, 5, 7, 24, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_matches_float_reference(K, n, k, m, bias):
    g = gen(n * k + m)
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF16)
    x = torch.randn(2, m, k, generator=g).to(BF16)  # leading dims are flattened and restored
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    y = K.linear_bf16(x, K.pack_bf16(w), n, b)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert y.shape == (2, m, n) and y.dtype == BF16
    # one bf16 rounding of the output plus float32 summation order
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


def test_linear_bf16_strided_input(K):
    g = gen(3)
    w = (torch.randn(80, 64, generator=g) * 0.1).to(BF16)
    x = torch.randn(6, 128, generator=g).to(BF16)[:, ::2]  # a non-contiguous view
    y = K.linear_bf16(x, K.pack_bf16(w), 80, None)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2 ** -7, atol=1e-2)


def _huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mapping holding t's data, from /proc/self/smaps."""
    addr, kb, inside = t.data_ptr(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                kb = int(line.split()[1])
    return kb


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text[text.index("[") + 1:text.index("]")]


def test_zeros_huge_gives_zeroed_tensors_on_huge_pages_and_returns_them(K):
    import psutil

    small = K.zeros_huge([3, 5], torch.float32)  # under 2 MB: a plain torch tensor
    assert small.shape == (3, 5) and small.dtype == torch.float32 and not small.any()
    t = K.zeros_huge([64, 1024, 512], BF16)  # 64 MB
    assert t.shape == (64, 1024, 512) and t.dtype == BF16 and not t.any()
    t[-1, -1, -1] = 3.0  # writable to its last element
    assert t.float().sum().item() == 3.0
    if os.environ.get("KEYACC_CPU_HUGE_PAGES") != "0":
        assert t.data_ptr() % (2 << 20) == 0
        if _thp_mode() in ("always", "madvise"):
            assert _huge_kb(t) >= 2048, "no 2 MB page in a 64 MB allocation that asked for them"
    del t
    rss = psutil.Process().memory_info().rss
    for _ in range(20):  # each freed with its tensor: 1.3 GB allocated in all, RSS stays put
        x = K.zeros_huge([64, 1024, 512], BF16)
        del x
    assert psutil.Process().memory_info().rss < rss + (200 << 20)


@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_linear_over_weights_on_huge_pages(K, m):
    """A weight of 2 MB or more is packed into a huge-page allocation (zeros_huge): the same
    products, the padding rows still zero."""
    g = gen(m)
    n, k = 1000, 1030  # 1,024 packed rows x 1,030: over 2 MB, 24 padding rows
    w = (torch.randn(n, k, generator=g) * 0.05).to(BF16)
    packed = K.pack_bf16(w)
    assert packed.numel() * 2 >= 2 << 20
    assert os.environ.get("KEYACC_CPU_HUGE_PAGES") == "0" or packed.data_ptr() % (2 << 20) == 0
    x = torch.randn(m, k, generator=g).to(BF16)
    y = K.linear_bf16(x, packed, n, None)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2 ** -7, atol=1e-3 * k ** 0.5)
    assert not packed[-1, :, -1, -8:].any()  # the group's last 8 rows (1,016..1,023) are padding


@pytest.mark.parametrize("m", [1, 9])
def test_linear_int8_matches_dequantised_reference(K, m):
    g = gen(m)
    w = (torch.randn(130, 70, generator=g) * 0.1).to(BF16)
    packed, scales = K.pack_int8(w)
    assert packed.dtype == torch.int8 and scales.shape == (130,)
    wf = w.float()
    s = wf.abs().amax(1) / 127
    deq = torch.round(wf / s[:, None]).clamp(-127, 127) * s[:, None]
    x = torch.randn(m, 70, generator=g).to(BF16)
    y = K.linear_int8(x, packed, scales, 130, None)
    torch.testing.assert_close(y.float(), x.float() @ deq.T, rtol=2 ** -7, atol=1e-2)
    # and the quantisation itself is close to the bf16 weights
    assert float((deq - wf).norm() / wf.norm()) < 0.01


def _mask(lengths, L, dtype):
    m = torch.zeros(len(lengths), 1, 1, L, dtype=dtype)
    for i, n in enumerate(lengths):
        m[i, ..., n:] = torch.finfo(dtype).min
    return m


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("h,hkv,d", [(4, 4, 16), (8, 2, 32), (6, 3, 8), (16, 8, 128)])
def test_decode_attention_matches_sdpa(K, dtype, h, hkv, d):
    g = gen(h * d)
    lengths = [1, 7, 33, 20]
    L, max_len = max(lengths), 64
    kb = torch.randn(6, hkv, max_len, d, generator=g).to(dtype)  # a slot buffer: views, not copies
    vb = torch.randn(6, hkv, max_len, d, generator=g).to(dtype)
    q = torch.randn(4, h, 1, d, generator=g).to(dtype)
    k, v = kb[:4, :, :L], vb[:4, :, :L]
    mask = _mask(lengths, L, dtype)
    out = K.decode_attention(q, k, v, mask, d ** -0.5)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(),
                                         enable_gqa=True).transpose(1, 2)
    assert out.shape == (4, 1, h, d)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)


def test_decode_attention_sliding_window_mask(K):
    g = gen(5)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g) for n in (1, 40, 40))
    mask = _mask([40, 30], 40, torch.float32)
    mask[0, ..., :25] = torch.finfo(torch.float32).min  # a window: only positions 25..39
    out = K.decode_attention(q, k, v, mask, 0.25)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rms_norm_and_add_rms_norm(K, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = gen(11)
    norm = LlamaRMSNorm(96, eps=1e-6)
    norm.weight.data = torch.randn(96, generator=g) * 0.5 + 1
    norm = norm.to(dtype)
    x = torch.randn(5, 96, generator=g).to(dtype)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    with torch.inference_mode():
        torch.testing.assert_close(K.rms_norm(x, norm.weight, 1e-6), norm(x), **tol)
        res = torch.randn(5, 96, generator=g).to(dtype)
        want_res = res + x
        out = K.add_rms_norm(x, res, norm.weight, 1e-6)  # res is updated in place
        torch.testing.assert_close(res, want_res, rtol=0, atol=0)
        torch.testing.assert_close(out, norm(want_res), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_silu_mul(K, dtype):
    g = gen(13)
    gu = (torch.randn(3, 2, 2 * 50, generator=g) * 4).to(dtype)
    ref = F.silu(gu[..., :50]) * gu[..., 50:]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(K.silu_mul(gu), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_kv_write_matches_transformers(K, dtype, with_norm):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = gen(17)
    B, H, Hkv, D, S, ML = 3, 4, 2, 32, 5, 24
    pos = torch.tensor([3, 0, 17])
    q = torch.randn(B, H * D, generator=g).to(dtype)
    k = torch.randn(B, Hkv * D, generator=g).to(dtype)
    v = torch.randn(B, Hkv * D, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None].float() * inv[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qn = kn = None
    qs, ks = q.view(B, 1, H, D), k.view(B, 1, Hkv, D)
    if with_norm:
        qn, kn = Qwen3RMSNorm(D, 1e-6), Qwen3RMSNorm(D, 1e-6)
        qn.weight.data = (torch.randn(D, generator=g) * 0.3 + 1)
        kn.weight.data = (torch.randn(D, generator=g) * 0.3 + 1)
        qn, kn = qn.to(dtype), kn.to(dtype)
        with torch.inference_mode():
            qs, ks = qn(qs), kn(ks)
    kbuf = torch.zeros(S, Hkv, ML, D, dtype=dtype)
    vbuf = torch.zeros(S, Hkv, ML, D, dtype=dtype)
    out = K.rope_kv_write(q, k, v, None if qn is None else qn.weight, None if kn is None else kn.weight, 1e-6,
                          cos, sin, kbuf, vbuf, pos)
    rq, rk = apply_rotary_pos_emb(qs.transpose(1, 2), ks.transpose(1, 2), cos[:, None], sin[:, None])
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
    torch.testing.assert_close(out, rq, **tol)
    for b in range(B):
        torch.testing.assert_close(kbuf[b, :, pos[b]], rk[b, :, 0], **tol)
        torch.testing.assert_close(vbuf[b, :, pos[b]], v[b].view(Hkv, D), rtol=0, atol=0)
    assert kbuf[S - 1].abs().sum() == 0 and kbuf[0, :, 4].abs().sum() == 0  # nothing else written


def test_rope_kv_write_rejects_out_of_range_position(K):
    kbuf = torch.zeros(2, 1, 4, 8)
    with pytest.raises(RuntimeError, match="position out of range"):
        K.rope_kv_write(torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(1, 8), None, None, 1e-6,
                        torch.ones(1, 8), torch.zeros(1, 8), kbuf, kbuf.clone(), torch.tensor([4]))


def _norm_rope_outputs(K) -> list[torch.Tensor]:
    """rope_kv_write, rms_norm and add_rms_norm over head sizes with 16- and 8-lane tails, partial rotary,
    both dtypes, a NaN, zeros of both signs and values in bf16's subnormal range."""
    g, outs = gen(23), []
    for dtype in (torch.float32, BF16):
        for D, R in ((128, 128), (80, 80), (24, 24), (40, 40), (128, 64), (96, 32), (128, 96), (20, 20), (36, 12)):
            B, H, Hkv = 3, 3, 1
            q = (torch.randn(B, H * D, generator=g) * 3).to(dtype)
            k, v = (torch.randn(B, Hkv * D, generator=g).to(dtype) for _ in range(2))
            q[0, 5], k[1, 2], q[2, 1], q[2, 1 + R // 2], q[1, D:2 * D] = float("nan"), float("nan"), 0.0, -0.0, 1e-39
            ang = torch.randn(B, R, generator=g)
            for norm in (None, (torch.randn(D, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype))):
                kb, vb = torch.zeros(4, Hkv, 8, D, dtype=dtype), torch.zeros(4, Hkv, 8, D, dtype=dtype)
                outs.append(K.rope_kv_write(q, k, v, norm and norm[0], norm and norm[1], 1e-6, ang.cos().to(dtype),
                                            ang.sin().to(dtype), kb, vb, torch.tensor([1, 7, 0]), torch.tensor([3, 0, 2])))
                outs += [kb, vb]
            x, res, w = (torch.randn(5, D, generator=g).to(dtype) for _ in range(3))
            x[1, 3], x[2] = float("nan"), 1e-39
            outs += [K.rms_norm(x, w, 1e-6), K.add_rms_norm(x, res, w, 1e-5), res]
    return outs


@pytest.mark.skipif(bool(os.environ.get("KEYACC_CPU_ISA")), reason="already a forced run")
def test_norm_and_rope_are_bitwise_the_same_on_every_path(K, tmp_path):
    """The norms and the rotary write have hand-written AVX-512 and AVX2 code beside the
    compiler's own vectorisation of one C++ body (the portable path): the same operations in the
    same order, so every path gives the same bits, checked against forced runs of the same cases
    on each path below this CPU's own. (A NaN comes out a NaN in the same places; which sign it
    has after adding two NaNs depends on the operands' order, which the compiler may swap.)"""
    paths = {"amx": ["avx2", "portable"], "avx512bf16": ["avx2", "portable"], "avx2": ["portable"]}.get(K.isa())
    if not paths:
        pytest.skip("the portable path is the only one here")
    mine = _norm_rope_outputs(K)
    bits = {torch.float32: torch.int32, BF16: torch.int16}
    for isa in paths:
        out = tmp_path / f"{isa}.pt"
        code = ("import sys, torch; from keyacc_ray import kernels; from tests.engine.test_cpu_kernels import "
                f"_norm_rope_outputs; torch.save(_norm_rope_outputs(kernels.load()), {str(out)!r})")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "KEYACC_CPU_ISA": isa},
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        theirs = torch.load(out)
        assert len(mine) == len(theirs)
        for i, (a, b) in enumerate(zip(mine, theirs)):
            nan = a.isnan()
            assert torch.equal(nan, b.isnan()), f"output {i}'s NaNs differ on {isa}"
            a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
            assert torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype])), f"output {i} differs on {isa}"


def _rerun_with(isa: str):
    env = {**os.environ, "KEYACC_CPU_ISA": isa}
    sampling = os.path.join(os.path.dirname(__file__), "test_sampling.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, sampling],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


@pytest.mark.skipif(bool(os.environ.get("KEYACC_CPU_ISA")), reason="already a forced run")
def test_portable_fallback():
    """The portable code (what a CPU without AVX-512 runs) passes the same tests."""
    _rerun_with("portable")


@pytest.mark.skipif(bool(os.environ.get("KEYACC_CPU_ISA")), reason="already a forced run")
def test_avx2_path(K):
    """The AVX2 + FMA linear kernel (what a CPU without AVX-512 runs: Zen 2/3, Haswell...), forced
    on this CPU, passes the same tests."""
    if K.isa() == "portable":
        pytest.skip("this CPU has no AVX2")
    _rerun_with("avx2")


@pytest.mark.skipif(bool(os.environ.get("KEYACC_CPU_ISA")), reason="already a forced run")
def test_avx512_without_amx(K):
    """Where this CPU has AMX (the products of 8 rows or more run on tiles), the AVX-512 kernels
    alone (a CPU with AVX512-BF16 and no AMX) pass the same tests."""
    if K.isa() != "amx":
        pytest.skip("no AMX here: the default run is the AVX-512 one")
    _rerun_with("avx512")


def test_avx2_rows_do_not_depend_on_the_batch(K):
    """On the AVX2 kernel every output adds its k-pairs in the same order whatever tile its row
    falls in (a full tile of 5 rows, a tail of 1-4, batch 1's wide tile): a row's result is
    bitwise the row computed alone, for bf16 and int8 weights."""
    if K.isa() != "avx2":
        pytest.skip("the AVX2 kernel's property (test_avx2_path runs this file on it)")
    g = gen(21)
    for m, n, k in [(7, 70, 37), (14, 200, 256), (33, 64, 1024)]:
        w = (torch.randn(n, k, generator=g) * 0.05).to(BF16)
        x = torch.randn(m, k, generator=g).to(BF16)
        b = torch.randn(n, generator=g).to(BF16)
        packed, (q, scales) = K.pack_bf16(w), K.pack_int8(w)
        for run in (lambda rows: K.linear_bf16(rows, packed, n, b),
                    lambda rows: K.linear_int8(rows, q, scales, n, b)):
            y = run(x)
            alone = torch.cat([run(x[i:i + 1]) for i in range(m)])
            pairs = torch.cat([run(x[i:i + 2]) for i in range(0, m - 1, 2)])
            assert torch.equal(y, alone)
            assert torch.equal(y[: pairs.shape[0]], pairs)


def test_amx_products_of_many_rows_match_the_float_reference(K):
    """Prefill-sized products (many rows, a last partial set of 16, widths not a multiple of 64):
    on AMX tiles where this CPU has them, else the AVX-512 / portable kernel; the same bound."""
    g = gen(9)
    for m, n, k in [(8, 64, 64), (16, 100, 256), (37, 200, 1024), (130, 96, 96)]:
        w = (torch.randn(n, k, generator=g) * 0.05).to(BF16)
        x = torch.randn(m, k, generator=g).to(BF16)
        b = torch.randn(n, generator=g).to(BF16)
        y = K.linear_bf16(x, K.pack_bf16(w), n, b)
        ref = x.float() @ w.float().T + b.float()
        assert y.dtype == BF16 and y.shape == (m, n)
        assert float((y.float() - ref).abs().max()) <= 0.02 * float(ref.abs().max()) + 1e-2


def test_int8_products_of_many_rows_match_the_dequantised_reference(K):
    """Weight-only int8 at prefill sizes (on AMX tiles where this CPU has them: the group's int8
    weights widened to bf16, the row sums scaled at the end; else the AVX-512 / AVX2 / portable
    kernel): the dequantised weights' product, the same bound as the bf16 products; and each
    row the same as the row computed alone (batch 1 never takes the tiles)."""
    g = gen(11)
    for m, n, k in [(8, 64, 64), (16, 100, 256), (37, 200, 1024), (130, 96, 96)]:
        w = (torch.randn(n, k, generator=g) * 0.05).to(BF16)
        packed, scales = K.pack_int8(w)
        wf = w.float()
        s = wf.abs().amax(1) / 127
        deq = torch.round(wf / s[:, None]).clamp(-127, 127) * s[:, None]
        x = torch.randn(m, k, generator=g).to(BF16)
        b = torch.randn(n, generator=g).to(BF16)
        y = K.linear_int8(x, packed, scales, n, b)
        ref = x.float() @ deq.T + b.float()
        assert y.dtype == BF16 and y.shape == (m, n)
        assert float((y.float() - ref).abs().max()) <= 0.02 * float(ref.abs().max()) + 1e-2
        alone = torch.cat([K.linear_int8(x[i:i + 1], packed, scales, n, b) for i in range(0, m, 7)])
        assert float((y[::7].float() - alone.float()).abs().max()) <= 0.01 * float(ref.abs().max()) + 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("D", [16, 24, 48, 80])
@pytest.mark.parametrize("G", [1, 2, 3])
def test_paged_decode_attention_matches_the_torch_reference(K, dtype, window, D, G):
    """Rows of mixed lengths read through block tables (blocks scattered, not in order, the last
    one part full), GQA heads sharing each K/V row (groups of one, a pair, a pair and one), a
    sliding window, head sizes that leave every tail of the kernels' register tiles: the kernel
    against the plain-torch path the engine falls back to (gather the blocks, one masked SDPA)."""
    from keyacc_ray.engine.paged_attention import reference_decode

    g = gen(D + window + G)
    nb, hkv, bs = 40, 2, 4
    kp = torch.randn(nb, hkv, bs, D, generator=g).to(dtype)
    vp = torch.randn(nb, hkv, bs, D, generator=g).to(dtype)
    lens = [1, 7, 16, 23, 2]
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = []
    for n in lens:
        own = [perm.pop() for _ in range(-(-n // bs))]
        tables.append(own + [0] * (width - len(own)))
    tl = torch.tensor(tables)
    ctx = torch.tensor(lens)
    q = torch.randn(len(lens), hkv * G, 1, D, generator=g).to(dtype)
    got = K.paged_decode_attention(q, kp, vp, tl.to(torch.int32), ctx, window, 0.3)
    ref = reference_decode(q.float(), kp.float(), vp.float(), tl, ctx, window, 0.3)
    assert got.shape == (len(lens), 1, hkv * G, D)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="block id out of range"):
        K.paged_decode_attention(q, kp, vp, torch.full_like(tl, nb, dtype=torch.int32), ctx, window, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("hkv,rows", [(2, 12), (4, 3), (5, 3), (3, 40), (8, 2)])
def test_a_sequences_kv_heads_go_together_as_they_go_alone(K, dtype, hkv, rows):
    """A batch's task takes several KV heads of one sequence (their rows of a block read in order;
    the heads split in chunks, the last one shorter, when the batch is small): each row bitwise
    the same as that row alone (one head a task), and the torch reference's within rounding."""
    from keyacc_ray.engine.paged_attention import reference_decode

    g = gen(hkv * 100 + rows)
    bs, D, G = 16, 64, 2
    lens = [1 + (37 * i) % 90 for i in range(rows)]
    per = [-(-n // bs) for n in lens]
    nb = sum(per) + 3
    kp = torch.randn(nb, hkv, bs, D, generator=g).to(dtype)
    vp = torch.randn(nb, hkv, bs, D, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(per)
    tl = torch.tensor([[perm.pop() for _ in range(p)] + [0] * (width - p) for p in per], dtype=torch.int32)
    ctx = torch.tensor(lens)
    q = torch.randn(rows, hkv * G, 1, D, generator=g).to(dtype)
    for window in (0, 20):
        got = K.paged_decode_attention(q, kp, vp, tl, ctx, window, 0.125)
        for b in range(rows):
            alone = K.paged_decode_attention(q[b:b + 1], kp, vp, tl[b:b + 1], ctx[b:b + 1], window, 0.125)
            assert torch.equal(got[b], alone[0]), (b, window)
        ref = reference_decode(q.float(), kp.float(), vp.float(), tl.long(), ctx, window, 0.125)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_decode_inputs_are_the_runner_arrays_made_in_one_call(K):
    """A decode step's inputs from the engine's arrays (token ids, positions, block-array rows) in
    one kernel call: the same tensors as the runner's numpy path, for rows of mixed lengths in any
    order, block boundaries included; out-of-range input is refused."""
    import numpy as np

    from keyacc_ray.engine.runner import ModelRunner

    rng = np.random.default_rng(3)
    bs, S, M = 4, 9, 6
    ba = rng.integers(0, 100, size=(S, M)).astype(np.int32)
    ids = rng.integers(0, 500, size=7).astype(np.int64)
    pos = np.array([0, 3, 4, 23, 7, 8, 15], dtype=np.int64)
    rows = np.array([8, 0, 3, 3, 5, 1, 2], dtype=np.int64)
    runner = ModelRunner.__new__(ModelRunner)  # only what _decode_inputs reads
    runner.block_size, runner.block_array, runner.device, runner._kernels = bs, ba, torch.device("cpu"), None
    want = runner._decode_inputs(ids, pos, rows)
    got = K.decode_inputs(*(torch.from_numpy(a) for a in (ids, pos, rows, ba)), bs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    with pytest.raises(RuntimeError, match="out of range"):
        K.decode_inputs(*(torch.from_numpy(a) for a in (ids, pos * 10, rows, ba)), bs)


def test_a_kernel_call_lets_the_other_python_threads_run(K):
    """The kernels run without the GIL, as torch's ops do: while the engine thread is inside a
    long product (a prefill chunk's), a replica's event loop thread runs Python (its streams,
    the hops it takes, its heartbeats) instead of waiting out the call."""
    import threading
    import time

    g = gen(7)
    n = k = 2048
    packed = K.pack_bf16((torch.randn(n, k, generator=g) * 0.05).to(BF16))
    m = 64
    while True:  # a call of at least 150 ms on this machine (AMX on 2 cores: 32k rows)
        x = torch.randn(m, k, generator=g).to(BF16)
        t = time.perf_counter()
        K.linear_bf16(x, packed, n, None)
        one = time.perf_counter() - t
        if one >= 0.15 or m >= 65536:
            break
        m *= 2
    assert one >= 0.1
    done = threading.Event()

    def call():
        K.linear_bf16(x, packed, n, None)
        done.set()

    th = threading.Thread(target=call)
    stamps = [time.perf_counter()]
    th.start()
    while not done.is_set():  # pure Python: it runs only while it holds the GIL
        sum(range(200))
        stamps.append(time.perf_counter())
    th.join()
    longest = max(b - a for a, b in zip(stamps, stamps[1:]))
    # (held, the loop makes no step for the whole call; released, its longest pause is the OS's
    # time slice on a busy machine)
    assert len(stamps) > 10 and longest < 0.75 * one, (len(stamps), longest, one)
