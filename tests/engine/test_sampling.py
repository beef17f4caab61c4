"""The batched sampler's two paths: the torch path (what CUDA runs) and the CPU kernel draw the
same token for the same row and uniform, over vocabularies small and real-sized, float32 and
bf16 logits (bf16 makes ties common), every filter and their mixes; and the top-p tie rule."""
import numpy as np
import pytest
import torch

from keyacc_ray import kernels
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.engine.sampling import Sampler, _info, kernel_sample_rows, sample_rows, uniforms

KWS = [dict(top_k=5), dict(top_p=0.9), dict(min_p=0.05), dict(top_k=40, top_p=0.8, min_p=0.01), {},
       dict(top_p=0.999999), dict(top_k=3, top_p=0.5), dict(top_k=100, top_p=0.95), dict(top_k=1),
       dict(top_p=0.3, min_p=0.2), dict(top_k=10_000_000)]


@pytest.fixture(scope="module")
def K():
    mod = kernels.load()
    assert mod is not None, f"kernels failed to build: {kernels.unavailable_reason()}"
    return mod


def rows_of(params):
    return np.array([_info(p)[3] for p in params])


@pytest.mark.parametrize("vocab", [7, 512, 5000, 40000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_draws_what_the_torch_path_draws(K, vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    n = 3 * len(KWS)
    x = (torch.randn(n, vocab, generator=g) * (1 + torch.rand(n, 1, generator=g) * 4)).to(dtype)
    params = [SamplingParams(temperature=0.2 + (i % 7) * 0.3, **KWS[i % len(KWS)]).validate() for i in range(n)]
    for pos in range(4):
        u = uniforms(list(range(n)), [pos] * n)
        want = sample_rows(x, params, u).tolist()
        got = kernel_sample_rows(K, x, rows_of(params), u).tolist()
        assert got == want


def test_kernel_rows_are_independent_of_the_batch(K):
    """A row draws the same token alone as in any batch (threads split the rows)."""
    g = torch.Generator().manual_seed(5)
    n = 300
    x = torch.randn(n, 2000, generator=g) * 3
    params = [SamplingParams(temperature=0.8, **KWS[i % len(KWS)]).validate() for i in range(n)]
    u = uniforms(list(range(n)), [9] * n)
    batch = kernel_sample_rows(K, x, rows_of(params), u).tolist()
    alone = [kernel_sample_rows(K, x[i:i + 1], rows_of(params[i:i + 1]), u[i:i + 1]).item() for i in range(0, n, 7)]
    assert alone == batch[::7]


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_top_p_keeps_every_token_as_likely_as_the_one_that_reaches_it(K, path):
    """Four tokens tie for second place: top-p 0.5 is reached inside the tie, so all four are
    kept (none of them depends on the order a sort leaves ties in), and nothing less likely."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 2.0, 0.0, -1.0, 0.0]])
    p = SamplingParams(temperature=1.0, top_p=0.5).validate()
    s = Sampler(K if path == "kernel" else None)
    drawn = set()
    for seed in range(300):
        s.add(f"r{seed}", p)
        drawn.add(s.sample(logits, [f"r{seed}"], [p], positions=[0])[0])
    assert drawn == {0, 1, 2, 3, 4}


def test_a_big_vocabulary_flat_row_widens_and_agrees(K):
    """A flat row over a real-sized vocabulary: top-p needs far more than the first candidates."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 151936, generator=g) * 0.1
    params = [SamplingParams(temperature=1.0, top_p=tp).validate() for tp in (0.5, 0.9, 0.99, 0.95)]
    u = uniforms([1, 2, 3, 4], [0, 0, 0, 0])
    assert kernel_sample_rows(K, x, rows_of(params), u).tolist() == sample_rows(x, params, u).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_argmax_is_torch_argmax(K, dtype):
    """Greedy rows on CPU: the first largest logit, as torch.argmax (ties, all-negative rows,
    -0 beside 0, a real-sized vocabulary)."""
    g = torch.Generator().manual_seed(4)
    for n, vocab in [(1, 7), (33, 512), (3, 1000), (5, 151936)]:
        x = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
        x[0, vocab // 2] = x[0, vocab // 3] = x.max() + 1  # a tie at the top: the first wins
        x[-1, vocab - 1] = x[-1].max() + 1  # the largest last (past the kernel's blocks of 64)
        if n > 1:
            x[1] = -x[1].abs() - 1
            x[1, 2], x[1, 4] = -0.0, 0.0  # equal maxima of different signs: the first
        assert K.argmax_rows(x).tolist() == x.argmax(-1).tolist()


@pytest.mark.parametrize("use_kernels", [True, False])
def test_the_batch_plan_is_kept_while_the_batch_holds_and_rebuilt_when_it_changes(K, use_kernels):
    """A decode batch reuses the sampler's per-batch plan (flags, parameter arrays, premixed seeds)
    step after step; a change of the rows' order, of a row's parameters or of its request makes a
    new one, and every row's draw is the one it makes alone, whatever happened before."""
    torch.manual_seed(3)
    vocab, n = 300, 6
    ps = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(n - 1)] + [SamplingParams(temperature=0)]

    def fresh(rid, p, x_row, pos):  # the row drawn by a sampler that has seen nothing else
        s = Sampler(K if use_kernels else None)
        s.add(rid, p)
        return s.sample(x_row[None], [rid], [p], positions=[pos])[0]

    s = Sampler(K if use_kernels else None)
    ids = [f"r{i}" for i in range(n)]
    for r, p in zip(ids, ps):
        s.add(r, p)
    for step in range(3):
        x = torch.randn(n, vocab)
        pos = [10 + step] * n
        got = s.sample(x, list(ids), list(ps), positions=pos)
        if step == 0:
            plan = s._plan
        assert s._plan is plan  # the same batch: the same plan
        assert got == [fresh(r, p, x[i], pos[i]) for i, (r, p) in enumerate(zip(ids, ps))]
    order = [5, 0, 4, 1, 3, 2]  # another order: a new plan, rows drawn as alone
    x = torch.randn(n, vocab)
    got = s.sample(x, [ids[i] for i in order], [ps[i] for i in order], positions=[20] * n)
    assert s._plan is not plan
    assert got == [fresh(ids[i], ps[i], x[j], 20) for j, i in enumerate(order)]
    plan = s._plan
    s.remove("r2")  # r2 leaves, and a greedy request comes in under its id
    greedy = SamplingParams(temperature=0)
    s.add("r2", greedy)
    ps2 = [greedy if i == 2 else ps[i] for i in order]
    got = s.sample(x, [ids[i] for i in order], ps2, positions=[21] * n)
    assert s._plan is not plan
    assert got[order.index(2)] == int(x[order.index(2)].argmax())
    assert got == [fresh(ids[i], p, x[j], 21) for j, (i, p) in enumerate(zip(order, ps2))]


@pytest.mark.parametrize("vocab", [512, 151936])
def test_kernel_agrees_on_masked_rows(K, vocab):
    """Rows where a grammar or a logit bias left a few tokens finite (the rest -inf), with top-k
    above and below how many are left, and top-p / min-p on top: the kernel's bounds and counts
    never keep a masked token and draw what the torch path draws."""
    g = torch.Generator().manual_seed(vocab + 1)
    kws = [dict(top_k=20), dict(top_k=2), dict(top_k=20, top_p=0.9), dict(top_p=0.8), dict(top_k=50, min_p=0.1), {}]
    n = 4 * len(kws)
    x = torch.full((n, vocab), float("-inf"))
    for r in range(n):
        left = [1, 3, 7, 40][r % 4]
        cols = torch.randperm(vocab, generator=g)[:left]
        x[r, cols] = torch.randn(left, generator=g) * 2
    params = [SamplingParams(temperature=0.7, **kws[i % len(kws)]).validate() for i in range(n)]
    for pos in range(3):
        u = uniforms(list(range(n)), [pos] * n)
        got = kernel_sample_rows(K, x, rows_of(params), u).tolist()
        assert got == sample_rows(x, params, u).tolist()
        assert all(torch.isfinite(x[r, t]) for r, t in enumerate(got))


def test_the_kernel_makes_the_uniforms_the_python_rule_makes(K):
    """The sampler's CPU path draws with uniforms the kernel makes from each row's premixed seed
    and position: the same numbers as uniforms(), so the same tokens as the torch path (seeds
    across the whole 64-bit range, positions small and large)."""
    from keyacc_ray.engine.sampling import _exp, _mix
    g = torch.Generator().manual_seed(11)
    n = 3 * len(KWS)
    x = torch.randn(n, 3000, generator=g) * 3
    params = [SamplingParams(temperature=0.9, **KWS[i % len(KWS)]).validate() for i in range(n)]
    seeds = [(i * 0x9E3779B97F4A7C15 + 12345) % 2**64 for i in range(n)]
    premixed = torch.from_numpy(_mix(np.array(seeds, dtype=np.uint64)).view(np.int64))
    temp, k, top_p, min_p = (torch.as_tensor(np.ascontiguousarray(c)) for c in rows_of(params).T)
    k = k.long()
    for positions in ([0] * n, list(range(n)), [2**40 + 7 * i for i in range(n)]):
        want = sample_rows(x, params, uniforms(seeds, positions)).tolist()
        e = _exp(x, temp.float())  # (rows without top-k read it)
        got = K.sample_rows_seeded(x, temp.float(), torch.where(k >= 3000, 0, k), top_p.float(), min_p.float(),
                                   premixed, torch.tensor(positions), e).tolist()
        assert got == want


@pytest.mark.parametrize("vocab", [512, 4096, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_on_peaked_rows_agrees(K, vocab, dtype):
    """Top-p without top-k on rows from nearly flat to one token taking nearly all (the kernel
    looks for the threshold among the few likeliest tokens first, by halving a bound from the
    largest, and among all that may be kept where that finds nothing): with and without min-p,
    bf16 ties, top-p from 0.05 to 0.999; the torch path's tokens."""
    g = torch.Generator().manual_seed(vocab + 7)
    n = 96
    scale = torch.logspace(-1, 1.5, n)[:, None]  # 0.1 (flat) .. 31 (one token)
    x = (torch.randn(n, vocab, generator=g) * scale).to(dtype)
    tps = [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999]
    params = [SamplingParams(temperature=[0.5, 1.0, 1.3][i % 3], top_p=tps[i % len(tps)],
                             min_p=0.02 if i % 5 == 0 else 0.0).validate() for i in range(n)]
    for pos in range(3):
        u = uniforms(list(range(n)), [pos] * n)
        assert kernel_sample_rows(K, x, rows_of(params), u).tolist() == sample_rows(x, params, u).tolist()
