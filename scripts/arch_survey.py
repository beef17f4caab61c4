#!/usr/bin/env python3
"""Which transformers decoder architectures the engine runs: for each, a random 2-layer model
(no download), four prompts decoded greedily and compared with transformers' generate(), plus a
KV hand-off between two engines. With --dtype bfloat16 it compares the CPU fast path (kernels on)
with plain torch instead, and for every difference prints how far apart the two candidate tokens'
float32 logits were (a near-tie at bf16 precision, or a real disagreement).

    python scripts/arch_survey.py                     # float32, against generate()
    python scripts/arch_survey.py --dtype bfloat16    # fast path vs plain torch
    python scripts/arch_survey.py FalconConfig ...    # only these
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from keyacc_ray.config import EngineConfig  # noqa: E402
from keyacc_ray.engine.llm_engine import LLMEngine  # noqa: E402
from keyacc_ray.engine.request import SamplingParams  # noqa: E402

STD = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=None)
GPT = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)  # GPT-2 / GPT-J names
ARCHS = {
    "GemmaConfig": dict(head_dim=16), "Gemma2Config": dict(head_dim=16, sliding_window=8),
    "Gemma3TextConfig": dict(head_dim=16, sliding_window=8), "Phi3Config": {}, "PhiConfig": dict(num_key_value_heads=4),
    "GPT2Config": GPT, "GPTNeoXConfig": dict(num_key_value_heads=None),
    "OPTConfig": dict(ffn_dim=128, num_key_value_heads=None, word_embed_proj_dim=64),
    "FalconConfig": dict(num_kv_heads=2, new_decoder_architecture=True), "OlmoConfig": {}, "Olmo2Config": {},
    "StableLmConfig": {}, "Starcoder2Config": {}, "GraniteConfig": {}, "CohereConfig": {},
    "MixtralConfig": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32),
    "Qwen3MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "GPTJConfig": dict(GPT, rotary_dim=8), "BloomConfig": dict(n_layer=2, n_head=4),
    "GlmConfig": dict(head_dim=16), "HeliumConfig": dict(head_dim=16), "SmolLM3Config": {}, "Exaone4Config": {},
    "DeepseekV3Config": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=24, n_group=1, topk_group=1),
    "LlamaConfig": dict(attention_bias=True), "Ernie4_5Config": {},
    "GraniteMoeConfig": dict(num_local_experts=4, num_experts_per_tok=2), "Olmo3Config": dict(sliding_window=8),
    "ApertusConfig": {}, "Lfm2Config": {}, "FalconH1Config": {}, "BitNetConfig": {},
}
DROP = {"GPT2Config": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "max_position_embeddings"),
        "BloomConfig": ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")}
DROP["GPTJConfig"] = DROP["GPT2Config"]


def build(name: str, dtype: torch.dtype, into: Path) -> str:
    args = {k: v for k, v in {**STD, **ARCHS[name]}.items() if k not in DROP.get(name, ())}
    args = {k: v for k, v in args.items() if v is not None or k == "bos_token_id"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**args))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked logits: greedy far from ties
    model.to(dtype).save_pretrained(into)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models/tiny-qwen3" / f, into / f)
    return str(into)


def hf_greedy(path: str, prompt: list[int], n: int, dtype: torch.dtype) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def survey_fp32(path: str, prompts, params) -> str:
    cfg = EngineConfig(model=path, max_num_seqs=8, dtype="float32", max_model_len=256)
    a, b = LLMEngine(cfg), LLMEngine(cfg)
    refs = [hf_greedy(path, p, params.max_tokens, torch.float32) for p in prompts]
    ok = a.generate(prompts, params) == refs
    a.add_request("h", prompts[0], params)  # four tokens here, the rest on b from the exported KV
    got = []
    while len(got) < 4:
        got += [t for o in a.step() for t in o.new_token_ids]
    b.import_request(a.export_request("h"))
    while b.has_unfinished():
        got += [t for o in b.step() for t in o.new_token_ids]
    return f"{'OK' if ok else 'MISMATCH'} handoff={'OK' if got == refs[0] else 'MISMATCH'}"


def survey_bf16(path: str, prompts, params) -> str:
    runs = [LLMEngine(EngineConfig(model=path, max_num_seqs=8, dtype="bfloat16", max_model_len=256,
                                   cpu_kernels=k)).generate(prompts, params) for k in ("auto", "off")]
    if runs[0] == runs[1]:
        return "OK (fast path == plain torch)"
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gaps = []
    for p, x, y in zip(prompts, *runs):
        if x != y:
            i = next(k for k in range(len(x)) if x[k] != y[k])
            with torch.inference_mode():
                lg = ref(torch.tensor([p + x[:i]])).logits[0, -1].float()
            gaps.append(round(abs(float(lg[x[i]] - lg[y[i]])), 4))
    return f"DIFF at float32 logit gaps {gaps}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archs", nargs="*", help="config class names (default: all)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((14, 12, 13, 3))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    work = Path(tempfile.mkdtemp(prefix="keyacc-archs-"))
    try:
        for name in args.archs or ARCHS:
            d = work / name
            try:
                path = build(name, getattr(torch, args.dtype), d)
                line = (survey_fp32 if args.dtype == "float32" else survey_bf16)(path, prompts, params)
            except Exception as e:  # noqa: BLE001 - report and go on
                line = f"ERROR {type(e).__name__}: {str(e)[:160]}"
            print(f"{name:20s} {line}", flush=True)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
