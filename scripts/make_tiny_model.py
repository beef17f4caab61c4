#!/usr/bin/env python3
"""Make a small causal LM with random weights and a real byte-level BPE tokenizer.

The model is saved with `save_pretrained` and is meant to be loaded back only through
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`: the same code path a
hub id takes. Nothing is downloaded.

    python scripts/make_tiny_model.py --arch qwen3 --size tiny --out models/tiny-qwen3
    python scripts/make_tiny_model.py --arch llama --size bench --dtype bfloat16 --out models/bench-llama
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

CORPUS = Path(__file__).with_name("tiny_corpus.txt")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with tools the Hermes / Qwen way: the tools' JSON in the system turn, an assistant's calls
# as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results in <tool_response> user turns
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n<tools>' }}{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\nTo call one: <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{%- else %}{{ call['function']['arguments'] | tojson }}{%- endif %}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

# size -> (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, max_positions)
SIZES = {
    "tiny": (64, 128, 2, 4, 2, 16, 512, 1024),
    "small": (256, 768, 4, 8, 4, 32, 2048, 2048),
    # ~33M parameters: compute per step large enough that Serve overhead is amortised (offload bench)
    "medium": (512, 1536, 8, 8, 4, 64, 8192, 2048),
    # The ~0.4B "bench" model of the CPU-kernel issue: 24 layers, hidden 1024, vocab 32000.
    "bench": (1024, 3072, 24, 16, 8, 128, 32000, 4096),
    # Qwen3-14B's shape (14.8B parameters, 29.5 GB in bf16): the GPU host check; use --device cuda.
    "qwen3-14b": (5120, 17408, 40, 40, 8, 128, 151936, 40960),
}
REAL_SHAPES = {"bench", "qwen3-14b"}  # random weights at the usual init scale, tied as Qwen ships them
ARCHS = {
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
}


def build_tokenizer(vocab_size: int, max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_len,
    )
    # A small corpus yields fewer merges than the model's vocab: fill the rest with plain added
    # tokens so every id the model can produce decodes to text.
    missing = vocab_size - len(fast)
    if 0 < missing <= 4096:
        fast.add_tokens([f"<|x{i}|>" for i in range(missing)])
    elif missing > 0:  # a real-size vocab: filler entries in the BPE vocab itself (150k added tokens load slowly)
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        n = len(tok.get_vocab())
        for i in range(vocab_size - n):
            vocab[f"<x{i}>"] = n + i
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                       eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>",
                                       unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=max_len)
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--init-std", type=float, default=None,
                    help="weight std; the default makes logits peaked so greedy decoding is far from ties")
    ap.add_argument("--device", default="cpu", help="where to initialise the weights (cuda: a 14B model in seconds)")
    ap.add_argument("--max-positions", type=int, default=None, help="the model's context (default: the size's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    import transformers

    hidden, inter, layers, heads, kv_heads, head_dim, vocab, max_pos = SIZES[args.size]
    max_pos = args.max_positions or max_pos
    tokenizer = build_tokenizer(vocab, max_pos)
    cls_name, extra = ARCHS[args.arch]
    if args.size == "bench" and args.arch in ("qwen3", "qwen2"):
        extra = {**extra, "tie_word_embeddings": True}  # as the small Qwen checkpoints ship
    config = getattr(transformers, cls_name)(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        initializer_range=args.init_std or (0.02 if args.size in REAL_SHAPES else 0.08),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **extra,
    )
    torch.manual_seed(args.seed)
    init_dtype = torch.float32 if args.size != "qwen3-14b" else getattr(torch, args.dtype)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=init_dtype)
    if args.size not in REAL_SHAPES:
        # A larger final-norm gain makes the logits peaked: greedy choices are far from ties,
        # so float32 comparisons between batched and single runs are meaningful.
        with torch.no_grad():
            model.model.norm.weight.mul_(8.0)
    model = model.to(getattr(torch, args.dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(args.out)
    if out.exists():  # save_pretrained does not always replace existing shards
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"arch": args.arch, "size": args.size, "dtype": args.dtype, "seed": args.seed,
            "parameters": sum(p.numel() for p in model.parameters())}
    (out / "keyacc_model_info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({"saved": str(out), **info}))


if __name__ == "__main__":
    main()
