"""The batched detokenizer's byte path: on a byte-level tokenizer decoding is the UTF-8 decoding
of the tokens' bytes, so the text the newest tokens add is the decoding of their bytes, with no
window to decode. It must give exactly what the window decode gives, step by step, special
tokens, partial UTF-8 bytes and stop strings included; and a tokenizer whose decoding is not
bytes (SentencePiece's leading space) never takes it."""
import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from keyacc_ray.engine.detok import IncrementalDetokenizer, _byte_table, step_all


@pytest.fixture(scope="module")
def tok(qwen3_path):
    return AutoTokenizer.from_pretrained(qwen3_path)


def run(tok, prompts, streams, by_bytes: bool | str, stop, skip):
    """Each stream's (hit, text taken) after every step, through step_all; `by_bytes` "stream":
    as the engine runs them, the streams decoded as bytes without stop strings through
    stream_step, the others through step_all."""
    ds = [IncrementalDetokenizer(tok, p, stop, skip_special_tokens=skip) for p in prompts]
    if not by_bytes:
        for d in ds:
            d.bytes = None
    out = []
    for step in range(len(streams[0])):
        last = step == len(streams[0]) - 1
        live = [i for i, d in enumerate(ds) if not d.stopped]
        fast = {i: ds[i].stream_step(streams[i][step]) for i in live if by_bytes == "stream" and ds[i].streams_bytes}
        rest = [i for i in live if i not in fast]
        hits = dict(zip(rest, step_all([ds[i] for i in rest], [streams[i][step] for i in rest])))
        out.append([(i, False, fast[i] + (ds[i].take(final=True) if last else "")) if i in fast
                    else (i, hits[i], ds[i].take(final=hits[i] or last)) for i in live])
    return out


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("stop", [[], ["e "], ["ab", "\n"]])
def test_the_byte_path_gives_what_the_window_decode_gives(tok, skip, stop):
    assert _byte_table(tok) is not None  # byte-level BPE, no clean-up: the byte path applies here
    rng = random.Random(7)
    text_ids = tok("Hello world, the quick brown fox; жЖ€𝄞 done\nab", add_special_tokens=False)["input_ids"]
    specials = tok.all_special_ids
    streams, prompts = [], []
    for _ in range(24):  # real text, random ids (partial bytes among them), special tokens
        streams.append([rng.choice([rng.choice(text_ids), rng.randrange(len(tok)), rng.choice(specials)])
                        for _ in range(40)])
        prompts.append([rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))])  # some end mid-character
    streams.append(text_ids[:40] + [0] * (40 - len(text_ids[:40])))
    prompts.append([1, 2])
    windows = run(tok, prompts, streams, False, stop, skip)
    assert run(tok, prompts, streams, True, stop, skip) == windows
    assert run(tok, prompts, streams, "stream", stop, skip) == windows
    if not stop:  # the whole text: the tokenizer's decode of the output after a prompt of whole characters
        for i, (p, ids) in enumerate(zip(prompts, streams)):
            head = tok.decode(p, skip_special_tokens=skip)
            if not head.endswith("\ufffd"):
                got = "".join(t for row in windows for j, _, t in row if j == i)
                assert head + got == tok.decode(p + ids, skip_special_tokens=skip)


def test_an_imported_detokenizer_continues_on_the_byte_path(tok):
    """Rebuilt from the output so far (a hand-off) mid-character, it goes on as the original."""
    rng = random.Random(3)
    ids = [rng.randrange(len(tok)) for _ in range(30)]
    a = IncrementalDetokenizer(tok, [5, 6], [])
    for t in ids[:17]:
        a.step(t)
    a.take(final=False)
    b = IncrementalDetokenizer(tok, [5, 6], [], output_ids=ids[:17], emitted_chars=a.emitted)
    assert b.pending == a.pending and b.bytes is not None
    for t in ids[17:]:
        a.step(t)
        b.step(t)
        assert a.take(final=False) == b.take(final=False)


@pytest.mark.parametrize("cut", [5, 17, 29])
def test_an_imported_stream_goes_on_without_repeating_text(tok, cut):
    """A stream without stop strings (stream_step, as the engine runs it) handed off after `cut`
    tokens, mid-character or not: the rebuilt one carries on with the same text and count, and
    its final take adds only what was pending, never text already sent."""
    rng = random.Random(cut)
    text_ids = tok("жЖ€𝄞 naïve 東京 🙂", add_special_tokens=False)["input_ids"]
    ids = [rng.choice([rng.randrange(len(tok)), rng.choice(text_ids)]) for _ in range(30)]
    a = IncrementalDetokenizer(tok, [5, 6], [])
    assert a.streams_bytes
    sent = "".join(a.stream_step(t) for t in ids[:cut])
    b = IncrementalDetokenizer(tok, [5, 6], [], output_ids=ids[:cut], emitted_chars=a.emitted)
    assert b.streams_bytes and b.pending == a.pending and b.emitted == len(sent)
    for t in ids[cut:]:
        got = a.stream_step(t)
        assert b.stream_step(t) == got
        sent += got
    tail = a.take(final=True)
    assert b.take(final=True) == tail and a.emitted == b.emitted == len(sent + tail)
    assert sent + tail == tok.decode(ids, skip_special_tokens=True)


def test_a_sentencepiece_tokenizer_decodes_windows(tmp_path):
    """Metaspace decoding drops the leading space of a text: "▁b" alone is "b", after "a" it is
    " b"; such a tokenizer always decodes windows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(["a b c the quick brown fox jumps over the lazy dog"] * 20,
                          trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False))
    sp = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")
    assert _byte_table(sp) is None
    ids = sp("the quick brown fox", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(sp, [], [])
    assert d.bytes is None
    pieces = []
    for i in ids:
        step_all([d], [i])
        pieces.append(d.take(final=False))
    assert "".join(pieces) + d.take(final=True) == sp.decode(ids)


@pytest.mark.parametrize("by_bytes", [True, False])
def test_a_long_output_keeps_only_the_text_not_yet_emitted(tok, by_bytes):
    """Thousands of tokens taken step by step: the pieces add up to the whole decode, a stop string
    met late is found even across the text already let go, and the detokenizer holds only the
    stop strings' holdback of text however long the output grows (a whole text copied at every
    token costs O(length) a token)."""
    words = tok(" the quick brown fox jumps over the lazy dog, жЖ€𝄞", add_special_tokens=False)["input_ids"]
    ids = words * 300
    stop = ["lazy dog, STOP"]
    d = IncrementalDetokenizer(tok, [1, 2], stop)
    if not by_bytes:
        d.bytes = None
    pieces, most = [], 0
    for t in ids:
        assert not step_all([d], [t])[0]
        pieces.append(d.take(final=False))
        most = max(most, len(d.text))
    pieces.append(d.take(final=True))
    assert "".join(pieces) == tok.decode(ids) and d.emitted == len(tok.decode(ids))
    assert most <= len(stop[0]) + 8
    # a stop string whose first characters are held back while the text before them goes out
    d = IncrementalDetokenizer(tok, [1, 2], stop)
    if not by_bytes:
        d.bytes = None
    stream = ids + tok(" lazy dog, STOP and more", add_special_tokens=False)["input_ids"]
    full, got = tok.decode(stream), []
    for t in stream:
        hit = step_all([d], [t])[0]
        got.append(d.take(final=hit))
        if hit:
            break
    assert hit and "".join(got) == full[:full.index(stop[0])]
