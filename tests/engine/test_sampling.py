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
    for n, vocab in [(1, 7), (33, 512), (5, 151936)]:
        x = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
        x[0, vocab // 2] = x[0, vocab // 3] = x.max() + 1  # a tie at the top: the first wins
        if n > 1:
            x[1] = -x[1].abs() - 1
            x[1, 2], x[1, 4] = -0.0, 0.0  # equal maxima of different signs: the first
        assert K.argmax_rows(x).tolist() == x.argmax(-1).tolist()
