"""Paged KV and chunked prefill: a step's prompts (whole or in chunks) and decode rows run as one
packed forward over the block pool, with the same tokens as transformers' generate() for each
prompt alone, on every architecture, sliding windows included."""
import pytest

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from tests.engine.test_fast_path import _random_model
from tests.helpers import hf_greedy


def _run(path: str, prompts: list[list[int]], n: int, **cfg):
    """Outputs, and per forward the (number of new tokens, cached before) of each item."""
    cfg = {"max_num_seqs": 16, "dtype": "float32", **cfg}
    eng = LLMEngine(EngineConfig(model=path, **cfg))
    calls = []
    real = eng.runner.forward
    eng.runner.forward = lambda items, **k: calls.append([(len(i.tokens), i.start) for i in items]) or real(items, **k)
    outs = eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return eng, outs, calls


@pytest.mark.parametrize("arch_fixture", ["qwen3_path", "llama_path", "qwen2_path", "mistral_path"])
def test_prompts_prefill_in_one_packed_forward(arch_fixture, request):
    path = request.getfixturevalue(arch_fixture)
    prompts = [[(31 * i + 7 * k) % 400 + 10 for k in range(17 + i)] for i in range(8)]
    eng, outs, calls = _run(path, prompts, 12)
    assert eng.runner.paged  # the load probe found the paged attention agrees with the model's own
    assert calls[0] == [(17 + i, 0) for i in range(8)]  # all eight prompts, unpadded, one forward
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(path, p, 12)


@pytest.mark.parametrize("arch_fixture", ["qwen3_path", "llama_path"])
@pytest.mark.parametrize("kernels", ["off", "auto"])
def test_chunked_prefill_mixes_with_decodes_like_generate(arch_fixture, kernels, request):
    path = request.getfixturevalue(arch_fixture)
    # a 7-token budget: the 40-token prompt goes in chunks of what is left beside the others,
    # chunk boundaries falling inside and across 4-token blocks
    prompts = [[(13 * k + 5) % 300 + 3 for k in range(40)], [9, 8, 7], [(5 * k) % 200 + 1 for k in range(11)]]
    eng, outs, calls = _run(path, prompts, 10, max_prefill_tokens=7, kv_block_size=4, cpu_kernels=kernels)
    assert calls[0] == [(7, 0)]
    assert any(any(n == 1 and start > 0 for n, start in c) and any(n > 1 and start > 0 for n, start in c)
               for c in calls)  # a chunk that attends over cached blocks, beside decode rows
    assert max(sum(n for n, start in c if not (n == 1 and start > 0)) for c in calls) <= 7
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(path, p, 10)


@pytest.mark.parametrize("cls,kw", [
    # a sliding window shorter than the prompts, on alternate layers (layer_types)
    ("Qwen3Config", {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                     "use_sliding_window": True}),
    ("MistralConfig", {"head_dim": 16, "sliding_window": 6}),
    ("GemmaConfig", {"head_dim": 16}),
])
@pytest.mark.parametrize("chunk", [4096, 5])
def test_paged_and_chunked_other_architectures(tmp_path, cls, kw, chunk):
    path = _random_model(tmp_path, cls, **kw)
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((14, 12, 13, 11))]
    eng, outs, calls = _run(path, prompts, 16, max_prefill_tokens=chunk, kv_block_size=4)
    assert eng.runner.paged
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(path, p, 16)


@pytest.mark.parametrize("cls,kw", [("Qwen3Config", {"head_dim": 16}),
                                    ("Qwen3Config", {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"],
                                                     "sliding_window": 8, "use_sliding_window": True})])
def test_decode_steps_without_the_fused_step_go_as_arrays(tmp_path, cls, kw):
    """The paged runner without the CPU kernels' fused step (what a GPU runs): a step of decode
    rows alone goes to the model's forward as arrays (`ModelRunner.decode`, no StepItem per row),
    prompts and mixed steps as items; the same tokens as generate() (sliding windows too)."""
    path = _random_model(tmp_path, cls, **kw)
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((14, 3, 9))]
    eng = LLMEngine(EngineConfig(model=path, dtype="float32", max_num_seqs=8, cpu_kernels="off",
                                 max_prefill_tokens=6, kv_block_size=4))
    assert eng.runner.paged and eng.runner.fused_step is None and eng.runner.decodes_arrays
    rows = []
    real = eng.runner.decode
    eng.runner.decode = lambda ids, pos, r: rows.append(len(ids)) or real(ids, pos, r)
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert rows and max(rows) == 3  # decode steps of every row, as arrays
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(path, p, 12)


def test_off_prefills_one_forward_each(qwen3_path):
    prompts = [[10 + k for k in range(20)], [20 + k for k in range(19)]]
    eng, outs, calls = _run(qwen3_path, prompts, 6, batched_prefill=False)
    assert calls[:2] == [[(20, 0)], [(19, 0)]]
    assert outs == [hf_greedy(qwen3_path, p, 6) for p in prompts]


def test_gathered_fallback_decodes_like_generate(qwen3_path):
    """paged_attention off: the model's own attention over KV gathered from the blocks."""
    prompts = [[(7 * k) % 250 + 2 for k in range(30)], [4, 5, 6, 7]]
    eng, outs, calls = _run(qwen3_path, prompts, 8, paged_attention="off", max_prefill_tokens=9, kv_block_size=4)
    assert not eng.runner.paged
    assert outs == [hf_greedy(qwen3_path, p, 8) for p in prompts]


def test_the_memory_profile_forward_runs_before_the_pool_exists(qwen3_path, monkeypatch):
    """The CUDA sizing step (a forward of the step budget through a temporary pool, then the real
    pool from what is left) on CPU through the same function: it runs at load order (no fused
    step, no paged attention yet), leaves the engine's pool untouched, and a later engine serves."""
    from keyacc_ray.engine import runner as runner_mod

    seen = []
    real = runner_mod.ModelRunner._fit_blocks

    def fit(self, wanted, fraction, gpu_util, max_batched):
        seen.append(self._profile_forward(max_batched).shape)  # what _profile_peak runs on CUDA
        return real(self, wanted, fraction, gpu_util, max_batched)

    monkeypatch.setattr(runner_mod.ModelRunner, "_fit_blocks", fit)
    eng = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", max_prefill_tokens=300, num_kv_blocks=64))
    assert seen == [(1, eng.runner.vocab_size)] and eng.runner.num_blocks == 64
    assert eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0)) == [hf_greedy(qwen3_path, [5, 6, 7], 4)]


def test_the_memory_profile_holds_the_whole_step_budget_when_it_exceeds_the_context(qwen3_path, monkeypatch):
    """A step packs up to max_prefill_tokens from several prompts, each at most the context: the
    profiled forward carries the whole budget (300 tokens as 128 + 128 + 44), not one context's
    worth (the GPU pool sized on 2k tokens of activations ran 8k-token steps out of memory)."""
    from keyacc_ray.engine import runner as runner_mod

    fed = []
    real_forward = runner_mod.ModelRunner.forward

    def forward(self, items, *a, **kw):
        fed.append([len(i.tokens) for i in items])
        return real_forward(self, items, *a, **kw)

    def fit(self, wanted, fraction, gpu_util, max_batched):
        monkeypatch.setattr(runner_mod.ModelRunner, "forward", forward)
        try:
            shape = self._profile_forward(max_batched).shape
        finally:
            monkeypatch.setattr(runner_mod.ModelRunner, "forward", real_forward)
        assert shape == (3, self.vocab_size)
        return wanted

    monkeypatch.setattr(runner_mod.ModelRunner, "_fit_blocks", fit)
    eng = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", max_prefill_tokens=300, max_model_len=128,
                                 num_kv_blocks=64))
    assert fed == [[128, 128, 44]]
    assert eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0)) == [hf_greedy(qwen3_path, [5, 6, 7], 4)]


@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_a_decode_batch_carries_its_arrays_from_step_to_step(qwen3_path, kernels):
    """While a step of decode rows alone follows another with the same rows, the engine takes the
    last step's sampled tokens, positions + 1 and rows instead of reading every sequence: at every
    step they equal what reading the sequences gives, as requests arrive, finish, get aborted and
    cross block boundaries; and the
    tokens are generate()'s."""
    import numpy as np

    from keyacc_ray.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=qwen3_path, dtype="float32", max_num_seqs=6, cpu_kernels=kernels,
                                 kv_block_size=4, max_prefill_tokens=64))
    real, carried = eng._decode_arrays, []

    def checked(seqs):
        got = real(seqs)
        last, eng._last_decode = eng._last_decode, None
        fresh = real(seqs)  # read from the sequences
        eng._last_decode = last
        carried.append(last is not None and got is not None)
        assert (got is None) == (fresh is None)
        if got is not None:
            assert all(np.array_equal(a, b) for a, b in zip(got, fresh))
        return got

    eng._decode_arrays = checked
    greedy = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": [(17 * i + 3 * k) % 300 + 5 for k in range(3 + 2 * i)] for i in range(5)}
    outs: dict = {}
    for step in range(60):
        if step in (0, 3, 7):  # arrivals while others decode
            for rid in list(prompts)[:2] if step == 0 else [list(prompts)[2 + (step > 3) * 1]]:
                eng.add_request(rid, prompts[rid], greedy)
        if step == 5:
            eng.add_request("gone", [1, 2, 3], greedy)
        if step == 9:
            eng.abort("gone")
        if step == 12:
            eng.add_request("r4", prompts["r4"], greedy)
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not eng.has_unfinished() and step > 12:
            break
    assert any(carried) and not all(carried)
    for rid, p in prompts.items():
        assert outs[rid] == hf_greedy(qwen3_path, p, 9), rid
