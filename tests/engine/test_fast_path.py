"""The engine with the CPU fast path against the plain path: token-identical in float32 for
every supported architecture, tie-aware in bf16, KV hand-offs across the two paths, the
load-time check that refuses a step which does not reproduce the model, and the fallbacks."""
import pytest
import torch

from keyacc_ray import kernels
from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.engine.runner import StepItem
from keyacc_ray.errors import ModelLoadError
from keyacc_ray.kernels.fastpath import PackedLinear
from tests.conftest import tiny_model
from tests.engine.test_bf16_handoff import bf16_path  # noqa: F401 - fixture
from tests.engine.test_kv_handoff import drain, run_until
from tests.helpers import PROMPTS, tie_aware_equal

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def engine(path, kernels_mode, **kw):
    return LLMEngine(EngineConfig(model=path, max_num_seqs=8, max_model_len=256, cpu_kernels=kernels_mode, **kw))


def mixed_batch(eng):
    """Eight prompts of different lengths decoding in one batch (slots of different lengths)."""
    prompts = [eng.tokenize(p) for p in PROMPTS[:8]]
    assert len({len(p) for p in prompts}) > 3
    return eng.generate(prompts, [GREEDY] * len(prompts))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
def test_float32_fast_path_is_token_identical(arch):
    path = tiny_model(arch)
    fast = engine(path, "on")
    assert fast.runner.fused_step is not None, "the fused step should check out for a Llama-family model"
    assert fast.runner.fast_path.norm > 0 and fast.runner.fast_path.mlp > 0
    assert fast.runner.paged and fast.runner.attn.kernels is not None  # the paged kernel in mixed steps
    assert mixed_batch(fast) == mixed_batch(engine(path, "off"))


@pytest.mark.parametrize("dtype_model", ["llama-bf16", "qwen3-as-bf16"])
def test_bf16_fast_path_tie_aware(bf16_path, dtype_model):  # noqa: F811
    path, kw = (bf16_path, {}) if dtype_model == "llama-bf16" else (tiny_model("qwen3"), {"dtype": "bfloat16"})
    fast, plain = engine(path, "on", **kw), engine(path, "off", **kw)
    assert fast.runner.fused_step is not None
    assert any(isinstance(m, PackedLinear) for m in fast.runner.model.modules())
    prompts = [fast.tokenize(p) for p in PROMPTS[:8]]
    got = fast.generate(prompts, [GREEDY] * 8)
    ref = plain.generate(prompts, [GREEDY] * 8)
    for p, r, g in zip(prompts, ref, got):
        assert tie_aware_equal(plain, p, r, g)


def test_int8_weights_run_and_stay_close(bf16_path):  # noqa: F811
    q8 = engine(bf16_path, "on", cpu_weight_quant="int8")
    packed = [m for m in q8.runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.packed.dtype == torch.int8 for m in packed if m is not q8.runner.model.lm_head)
    assert q8.runner.fused_step is not None
    bf = engine(bf16_path, "on")
    prompts = [bf.tokenize(p) for p in PROMPTS[:8]]
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        a = q8.runner.model(ids).logits[0, -1].float()
        b = bf.runner.model(ids).logits[0, -1].float()
    assert float((a - b).norm() / b.norm()) < 0.1  # int8 weights move logits a little, not a lot
    outs = q8.generate(prompts, [GREEDY] * 8)
    assert all(len(o) == 20 and all(0 <= t < q8.runner.vocab_size for t in o) for o in outs)


@pytest.mark.parametrize("direction", ["fast->plain", "plain->fast"])
def test_handoff_between_paths_is_exact_in_float32(qwen3_path, direction):
    a, b = (engine(qwen3_path, "on"), engine(qwen3_path, "off"))
    if direction == "plain->fast":
        a, b = b, a
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = a.tokenize(PROMPTS[3])
    a.add_request("x", ids, params)
    a.add_request("y", a.tokenize(PROMPTS[6]), params)  # the exporter keeps other work
    first = run_until(a, "x", 7)
    b.import_request(a.export_request("x"))
    rest = drain(b)["x"]
    ref = engine(qwen3_path, "off").generate([ids], [params])[0]
    assert first + rest == ref


def test_check_refuses_a_step_that_does_not_reproduce_the_model(qwen3_path):
    from keyacc_ray.kernels.fused_step import FusedDecodeStep

    eng = engine(qwen3_path, "on")
    step = FusedDecodeStep.build(eng.runner.model, kernels.load())
    assert eng.runner._check_fused_step(step)
    step.layers[1].scale *= 1.5  # a model whose attention scales differently
    step.native = step.native_args()
    assert not eng.runner._check_fused_step(step)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # the probe holds no block


def test_without_kernels_auto_falls_back_and_on_fails(qwen3_path, monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda verbose=False: None)
    eng = engine(qwen3_path, "auto")
    assert eng.runner.fast_path is None and eng.runner.fused_step is None
    assert len(eng.generate([eng.tokenize(PROMPTS[0])], [GREEDY])[0]) == 20
    with pytest.raises(ModelLoadError, match="cpu_kernels=on"):
        engine(qwen3_path, "on")


def test_off_is_plain_transformers(qwen3_path):
    eng = engine(qwen3_path, "off")
    assert eng.runner.fast_path is None and eng.runner.fused_step is None
    assert eng.runner.model.config._attn_implementation == "keyacc_paged"  # torch's SDPA over the block pool


def _random_model(tmp_path, cls: str, **kw) -> str:
    """A 2-layer random model of another architecture, with the tiny tokenizer beside it."""
    import shutil

    import transformers

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    cfg = getattr(transformers, cls)(**{**base, **kw})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked logits: greedy far from ties
    model.save_pretrained(tmp_path)
    src = tiny_model("qwen3")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        try:
            shutil.copy(f"{src}/{f}", tmp_path / f)
        except FileNotFoundError:
            pass
    return str(tmp_path)


@pytest.mark.parametrize("cls,kw,fused", [
    # per-layer sliding windows (layer_types): the fused step picks each layer's mask
    ("Qwen3Config", {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                     "use_sliding_window": True}, True),
    # Gemma's RMSNorm scales by (1 + w) and its embedding by sqrt(hidden): the checks keep them
    ("GemmaConfig", {"head_dim": 16}, False),
])
def test_other_architectures_stay_exact(tmp_path, cls, kw, fused):
    path = _random_model(tmp_path, cls, **kw)
    fast, plain = engine(path, "auto"), engine(path, "off")
    assert (fast.runner.fused_step is not None) == fused
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 20)]  # past the 8-token window
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 3
    assert fast.generate(prompts, params) == plain.generate(prompts, params)


def test_decode_rows_from_the_block_array_equal_those_from_the_tables(qwen3_path):
    """A decode step's inputs gathered from the block array (one pass, the engine's steps) are the
    ones built from each row's own table list (rows without an array row): ids, positions, block
    and row-in-block of each new token, context lengths, and every row's blocks up to its token."""
    import dataclasses

    from keyacc_ray.engine.runner import StepItem

    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=6, kv_block_size=4))
    for i, n in enumerate([3, 9, 17, 5, 30]):  # contexts across block boundaries
        eng.add_request(f"r{i}", list(range(10 + i, 10 + i + n)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(7):
        eng.step()
    sched = eng.scheduler.schedule()  # the next step's rows, their blocks grown as a step grows them
    table, row = eng.blocks.table_ref, eng.blocks.row.get
    items = [StepItem([s.token_ids[-1]], s.num_cached, table(s.request_id), "last", row(s.request_id, -1))
             for s in sched.decode]
    assert len(items) == 5 and all(it.row >= 0 and it.is_decode for it in items)
    fast = eng.runner._decode_rows(items)
    slow = eng.runner._decode_rows([dataclasses.replace(it, row=-1) for it in items])
    for a, b in zip(fast[:4], slow[:4]):
        assert torch.equal(a, b)
    assert torch.equal(fast[5], slow[5])
    bs = eng.blocks.block_size
    for r, it in enumerate(items):
        need = it.start // bs + 1
        assert fast[4][r, :need].tolist() == slow[4][r, :need].tolist() == it.blocks[:need]


@pytest.mark.parametrize("case", ["llama-bf16", "qwen3-as-bf16", "llama-int8", "qwen3-windows-bf16", "qwen3-float32",
                                  "llama-float32"])
def test_the_native_layer_loop_is_the_python_loop_bit_for_bit(bf16_path, tmp_path, case):  # noqa: F811
    """decode_layers (the loop over the layers in C++) against fused_step.py's Python loop on the
    same decode rows (mixed lengths, several blocks): the same logits and the same K/V written,
    bit for bit, for bf16 and int8 weights, float32 weights (not packed), q/k norms and per-layer
    sliding windows."""
    kw = {"cpu_weight_quant": "int8"} if case == "llama-int8" else {}
    if case.startswith("qwen3-windows"):
        path = _random_model(tmp_path, "Qwen3Config", head_dim=16, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=8, use_sliding_window=True)
        kw["dtype"] = "bfloat16"
    elif case == "qwen3-as-bf16":
        path, kw["dtype"] = tiny_model("qwen3"), "bfloat16"
    elif case.endswith("float32"):  # plain weights: torch's own products inside the loop
        path = tiny_model(case.split("-")[0])
    else:
        path = bf16_path
    eng = engine(path, "on", **kw)
    r, fs = eng.runner, eng.runner.fused_step
    assert fs is not None and fs.native is not None, "the native loop should be on"
    items = r._probe_items()
    r.forward(items)
    rows = r._decode_rows([StepItem([7], len(it.tokens), it.blocks) for it in items])
    before = [t.clone() for t in r.cache.k + r.cache.v]
    outs = []
    for native in (fs.native, None):
        for t, b in zip(r.cache.k + r.cache.v, before):
            t.copy_(b)
        fs.native = native
        with torch.inference_mode():
            logits = fs(*rows, r.cache.k, r.cache.v, r.windows)
        outs.append((logits.clone(), [t.clone() for t in r.cache.k + r.cache.v]))
    (a, ka), (b, kb) = outs
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(ka, kb)) and not all(torch.equal(x, y) for x, y in zip(ka, before))
