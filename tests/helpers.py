"""Reference outputs from transformers' own generate(), one prompt at a time."""
from __future__ import annotations

import functools

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
