"""The batched detokenizer's shortcut: on a byte-level tokenizer a token whose own text is whole
characters, after a context that decoded completely, adds its own text without a window decode.
It must give exactly what the window decode gives, step by step, special tokens, partial UTF-8
bytes and stop strings included; and a tokenizer whose decoding is not additive (SentencePiece's
leading space) never takes it."""
import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from keyacc_ray.engine.detok import IncrementalDetokenizer, _additive, step_all


@pytest.fixture(scope="module")
def tok(qwen3_path):
    return AutoTokenizer.from_pretrained(qwen3_path)


def run(tok, streams, additive: bool, stop, skip):
    """Each stream's (text taken, stop hit) after every step, through step_all."""
    ds = [IncrementalDetokenizer(tok, [1, 2, 3], stop, skip_special_tokens=skip) for _ in streams]
    for d in ds:
        d.additive = additive and d.additive
    out = []
    for step in range(len(streams[0])):
        live = [i for i, d in enumerate(ds) if not d.stopped]
        hits = step_all([ds[i] for i in live], [streams[i][step] for i in live])
        out.append([(i, h, ds[i].take(final=h or step == len(streams[0]) - 1)) for i, h in zip(live, hits)])
    return out


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("stop", [[], ["e "], ["ab", "\n"]])
def test_the_shortcut_gives_what_the_window_decode_gives(tok, skip, stop):
    assert _additive(tok)  # byte-level BPE, no clean-up: the shortcut applies here
    rng = random.Random(7)
    text_ids = tok("Hello world, the quick brown fox; жЖ€𝄞 done\nab", add_special_tokens=False)["input_ids"]
    specials = tok.all_special_ids
    streams = []
    for _ in range(24):  # real text, random ids (partial bytes among them), special tokens
        s = [rng.choice([rng.choice(text_ids), rng.randrange(len(tok)), rng.choice(specials)]) for _ in range(40)]
        streams.append(s)
    streams.append(text_ids[:40] + [0] * (40 - len(text_ids[:40])))
    assert run(tok, streams, True, stop, skip) == run(tok, streams, False, stop, skip)


def test_a_sentencepiece_tokenizer_is_not_additive(tmp_path):
    """Metaspace decoding drops the leading space of a text: "▁b" alone is "b", after "a" it is
    " b"; such a tokenizer always decodes windows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(["a b c the quick brown fox jumps over the lazy dog"] * 20,
                          trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False))
    sp = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")
    assert not _additive(sp)
    ids = sp("the quick brown fox", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(sp, [], [])
    assert not d.additive
    pieces = []
    for i in ids:
        step_all([d], [i])
        pieces.append(d.take(final=False))
    assert "".join(pieces) + d.take(final=True) == sp.decode(ids)
