"""Reference outputs from transformers' own generate(), one prompt at a time."""
from __future__ import annotations

import functools
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@functools.lru_cache(maxsize=4)
def hf_model(path: str, dtype: str = "float32"):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    return list(_hf_greedy(path, tuple(prompt_ids), max_new_tokens, stop_at_eos))


@functools.lru_cache(maxsize=1024)
def _hf_greedy(path: str, prompt_ids: tuple, max_new_tokens: int, stop_at_eos: bool) -> tuple:
    model, tok = hf_model(path)
    ids = torch.tensor([prompt_ids])
    kw = {} if stop_at_eos else {"eos_token_id": None, "min_new_tokens": max_new_tokens}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id, **kw)
    return tuple(out[0, ids.shape[1]:].tolist())


PROMPTS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "a",
    "Tell me a story about a robot who learns to paint.", "What is the capital of France?",
    "def hello(name):\n    return", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100", "café naïve Straße 東京",
    "Once upon a time, in a small village by the sea, there lived an old engineer who built machines",
    "keyacc-ray serves", "Sphinx of black quartz, judge my vow.", "🙂 🚀 ✨",
    "The scheduler admits a request only when its key-value blocks fit; otherwise the request waits.",
    "x", "How vexingly quick daft zebras jump!", "Explain how a transformer model predicts the next token",
    "for i in range(10):", "Pack my box with five dozen liquor jugs",
]


def tie_aware_equal(ref_engine, prompt: list[int], ref: list[int], got: list[int], ulps: int = 3) -> bool:
    """The bf16 rule (../shared/NOTES.md): where two runs first differ, `got`'s token must be
    within `ulps` bf16 rounding steps (at the top logit's magnitude, at least 0.05) of the best
    logit of `ref_engine`'s model at that point. Each kernel rounds its products to bf16, so a tie
    at that resolution can go either way; anything further apart is a real difference. (A fixed
    margin would be below one bf16 step for a model whose logits pass 8.)"""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            with torch.inference_mode():
                logits = ref_engine.runner.model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
            top = float(logits.max())
            step = 2.0 ** (torch.floor(torch.log2(torch.tensor(abs(top) + 1e-6))).item() - 7)
            return float(top - logits[b]) <= max(0.05, ulps * step)
    return len(ref) == len(got)


# The float32 near-tie tolerance, in float32 spacings at the top logit. Two correct computations of
# the same next-token logits lie this far apart (`python scripts/logit_spread.py`, the largest
# difference over the vocabulary: generate()'s own steps against a full forward of the sequence up
# to 21 on tiny-qwen3 and 55 on medium-qwen3, the engine's up to 32 and 54; the engine against
# generate() up to about their sum), so where generate()'s two best logits are closer than this,
# either token is right. A wrong block of KV or a wrong position moves logits by orders more.
TIE_ULPS = 128


def float32_spacing(x: float) -> float:
    """float32's spacing (one ulp) at |x|."""
    return 2.0 ** (math.frexp(abs(x))[1] - 24)


def float32_parting(path: str, prompt_ids: list[int], want: list[int], got: list[int], at: int,
                    ulps: int = TIE_ULPS) -> dict:
    """Where a float32 completion `got` parts from generate()'s `want` (at index `at`):
    generate()'s top logit there less that of `got`'s token (a full forward; `gap` and `gap_ulps`,
    in float32 spacings at the top logit), whether the rest of `got` is generate()'s own
    continuation from its token (`rest_follows`), and the verdict (`near_tie`: within `ulps` and
    the rest follows: a tie, not a defect)."""
    model, _ = hf_model(path)
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt_ids) + want[:at]])).logits[0, -1].float()
    top = float(logits.max())
    gap = top - float(logits[got[at]])
    spacings = gap / float32_spacing(top)
    rest = len(want) - at - 1
    follows = got[at + 1:] == (hf_greedy(path, list(prompt_ids) + got[:at + 1], rest) if rest > 0 else [])
    return {"gap": round(gap, 9), "gap_ulps": round(spacings, 1), "rest_follows": follows,
            "near_tie": 0 <= spacings <= ulps and follows}
