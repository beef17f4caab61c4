"""Incremental detokenisation with stop strings.

Text is emitted only when the newest tokens decode to complete characters (no U+FFFD tail), so a
stream never carries a broken UTF-8 sequence; and the last `max_stop_len - 1` characters are
held back while a stop string could still be completing, so a stop string never leaks.
"""
from __future__ import annotations

import random

CONTEXT_TOKENS = 6
_BATCHED: dict[int, bool] = {}  # id(tokenizer) -> its Rust backend decodes exactly as tokenizer.decode
_ONE: dict[tuple[int, bool], dict[int, str]] = {}  # (id(tokenizer), skip) -> token id -> decode([id])
_BYTES: dict[int, "ByteTable | None"] = {}  # id(tokenizer) -> its tokens' bytes, where decoding is bytes
_UNSEEN = object()  # a token not yet in ByteTable.texts


def _gpt2_chars() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode), character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class ByteTable:
    """Each token's bytes under a byte-level decoder (GPT-2, Llama 3, Qwen, ...), where decoding
    a sequence is decoding the concatenation of its tokens' bytes as UTF-8 (invalid bytes as
    U+FFFD): a token's bytes are its characters through the byte-level alphabet, or its text's
    UTF-8 where a character is outside it (added tokens), none for a special token skipped. Then
    the text a token adds after a context that decoded completely is the UTF-8 decoding of the
    bytes since: no window to decode (step_all)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chars = _gpt2_chars()
        # what decode(skip_special_tokens=True) leaves out: every added token marked special
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special = {i for i, t in added.items() if getattr(t, "special", False)}
        self.special |= set(getattr(tokenizer, "all_special_ids", []))
        self.added = sorted(added)
        # token id -> its bytes, filled as tokens come up: special tokens skipped, and kept
        self.skipping: dict[int, bytes] = {}
        self.keeping: dict[int, bytes] = {}
        # token id -> its text after a context that decoded completely: its bytes decoded, where
        # they are whole characters (else None: the stream waits for the rest, as bytes)
        self.texts: dict[bool, dict[int, str | None]] = {True: {}, False: {}}

    def of(self, token: int, skip: bool) -> bytes:
        table = self.skipping if skip else self.keeping
        got = table.get(token)
        if got is None:
            if skip and token in self.special:
                got = b""
            else:
                text = self.tokenizer.convert_ids_to_tokens(token)
                chars = self.chars
                got = bytes(chars[c] for c in text) if all(c in chars for c in text) else text.encode()
            if len(table) < 1 << 21:
                table[token] = got
        return got

    def text_of(self, token: int, skip: bool) -> str | None:
        """The text the token adds after a context that decoded completely (nothing pending):
        its bytes decoded, or None where they end inside a character or add nothing."""
        texts = self.texts[skip]
        if token in texts:
            return texts[token]
        text = self.of(token, skip).decode("utf-8", "replace")
        got = text if text and text[-1] != "\ufffd" else None
        if len(texts) < 1 << 21:
            texts[token] = got
        return got


def _byte_table(tokenizer) -> ByteTable | None:
    """The tokenizer's ByteTable where its decoder is byte-level alone (no clean-up of spaces after
    it) and decoding random windows (special tokens, partial characters) as bytes gives
    `tokenizer.decode`'s text, both with and without special tokens; else None (a SentencePiece
    decoder, for one, drops the leading space of a text, and decodes windows)."""
    key = id(tokenizer)
    if key not in _BYTES:
        ok = (type(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)).__name__ == "ByteLevel"
              and not getattr(tokenizer, "clean_up_tokenization_spaces", False))
        table = ByteTable(tokenizer) if ok else None
        if table is not None:
            rng = random.Random(1)
            n = len(tokenizer)
            added = table.added[:4096]
            windows = [[rng.randrange(n) for _ in range(rng.randint(1, 8))] for _ in range(300)]
            for i, a in enumerate(added):  # every added token (special or not) among random ones
                w = windows[i % len(windows)]
                w.insert(rng.randrange(len(w) + 1), a)
            try:
                for w in windows:
                    for skip in (True, False):
                        got = b"".join(table.of(t, skip) for t in w).decode("utf-8", "replace")
                        if got != tokenizer.decode(w, skip_special_tokens=skip):
                            table = None
                            break
                    if table is None:
                        break
            except Exception:  # noqa: BLE001 - any surprise: windows
                table = None
        _BYTES[key] = table
    return _BYTES[key]


def _backend_agrees(tokenizer) -> bool:
    """Whether the Rust tokenizer's own decode (what decode_many calls) gives `tokenizer.decode`'s
    text: checked once per tokenizer on windows of random and special token ids (a tokenizer
    without a Rust backend, or one whose decode post-processes the text, goes through
    `tokenizer.decode`)."""
    key = id(tokenizer)
    if key not in _BATCHED:
        backend = getattr(tokenizer, "_tokenizer", None)
        ok = backend is not None and hasattr(backend, "decode")
        if ok:
            rng = random.Random(0)
            n = len(tokenizer)
            special = list(getattr(tokenizer, "all_special_ids", []))[:8]
            probes = [[rng.randrange(n) for _ in range(rng.randint(1, 8))] for _ in range(64)]
            probes += [[*p[:2], s, *p[2:]] for p, s in zip(probes, special)]
            try:
                for skip in (True, False):
                    got = [backend.decode(p, skip_special_tokens=skip) for p in probes]
                    ok = ok and got == [tokenizer.decode(p, skip_special_tokens=skip) for p in probes]
            except Exception:  # noqa: BLE001 - any mismatch in kind: row by row
                ok = False
        _BATCHED[key] = ok
    return _BATCHED[key]


def decode_many(tokenizer, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """`tokenizer.decode` of each list: straight into the Rust tokenizer where it agrees."""
    if seqs and _backend_agrees(tokenizer):
        # one call per window into the Rust tokenizer: its decode_batch hands the windows to a
        # thread pool, which beside torch's busy threads took about 10x longer than this
        decode = tokenizer._tokenizer.decode
        return [decode(s, skip_special_tokens=skip_special_tokens) for s in seqs]
    return [tokenizer.decode(s, skip_special_tokens=skip_special_tokens) for s in seqs]


def step_all(detoks: list["IncrementalDetokenizer"], tokens: list[int]) -> list[bool]:
    """`d.step(t)` for every (detokenizer, token) pair, the decoding done in a few batched calls
    (by skip_special_tokens); returns which ones hit a stop string."""
    groups: dict[bool, list[int]] = {}
    hits: list = [None] * len(detoks)
    for i, (d, t) in enumerate(zip(detoks, tokens)):
        d.ids.append(t)
        table = d.bytes
        if table is not None:  # bytes since the last text, decoded: no window to decode
            skip = d.skip_special_tokens
            b = (table.skipping if skip else table.keeping).get(t)
            pending = d.pending + (b if b is not None else table.of(t, skip))
            text = pending.decode("utf-8", "replace")
            if not text or text[-1] == "\ufffd":  # a character still incomplete: wait
                d.pending = pending
                hits[i] = False
            else:
                hits[i] = d._add_text(text)
            continue
        groups.setdefault(d.skip_special_tokens, []).append(i)
    texts: list = [None] * len(detoks)
    for skip, rows in groups.items():
        tok = detoks[rows[0]].tokenizer
        one = _ONE.setdefault((id(tok), skip), {})  # a one-token window (the usual prefix): decoded once
        wins, where = [], []
        for i in rows:
            d = detoks[i]
            pc = d.prefix_text
            if pc is not None and pc[0] == d.prefix_offset and pc[1] == d.read_offset:
                p = pc[2]  # nothing emitted since the last step: the same prefix window
                where.append((i, p, len(wins)))
                wins.append(d.ids[d.prefix_offset:])
                continue
            prefix = d.ids[d.prefix_offset:d.read_offset]
            if len(prefix) == 1 and prefix[0] in one:
                p = one[prefix[0]]
            else:
                p = len(wins)
                wins.append(prefix)
            where.append((i, p, len(wins)))
            wins.append(d.ids[d.prefix_offset:])
        out = decode_many(tok, wins, skip)
        for i, p, f in where:
            if not isinstance(p, str):
                ids = wins[p]
                p = out[p]
                if len(ids) == 1 and len(one) < 1 << 20:
                    one[ids[0]] = p
            texts[i] = (p, out[f])
        for i in rows:
            d = detoks[i]
            d.prefix_text = (d.prefix_offset, d.read_offset, texts[i][0])
            hits[i] = d._advance(*texts[i])
            if d.bytes_later is not None and d.prefix_offset >= d.prompt_tail and d.read_offset == len(d.ids):
                d.bytes, d.bytes_later, d.pending = d.bytes_later, None, b""  # only whole characters behind
    return hits


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str],
                 output_ids: list[int] = (), emitted_chars: int = 0, include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop  # the stop string that matched stays in the text
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prompt_tail = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # the text not yet emitted (and the stop strings' holdback): `dropped` characters of the
        # output's text before it were emitted and let go, so that a long output does not copy
        # its whole text at every token
        self.text = ""
        self.dropped = 0
        self.emitted = 0  # characters of the output's text emitted so far (what a hand-off carries)
        self.stopped = False
        self.prefix_text: tuple[int, int, str] | None = None  # (offsets, text) of the last prefix window decoded
        # where decoding is bytes: ids[read_offset:]'s bytes in `pending` (not after a prompt that
        # ends inside a character: its bytes would join the output's)
        self.bytes = _byte_table(tokenizer)
        self.bytes_later = None  # the byte path once the window has left such a prompt behind
        if self.bytes is not None and self.ids and self._decode(self.ids).endswith("\ufffd"):
            self.bytes, self.bytes_later = None, self.bytes
        for t in output_ids:  # rebuild the state of a sequence imported mid-decode
            self._append(t)
        self.emitted = emitted_chars
        cut = min(emitted_chars, len(self.text))  # (what the stream already carried: let go)
        self.text, self.dropped = self.text[cut:], cut
        self.pending = b"" if self.bytes is None else b"".join(
            self.bytes.of(t, skip_special_tokens) for t in self.ids[self.read_offset:])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, token_id: int) -> None:
        self.ids.append(token_id)
        self._emit(self._decode(self.ids[self.prefix_offset:self.read_offset]),
                   self._decode(self.ids[self.prefix_offset:]))

    def _emit(self, prefix: str, full: str) -> None:
        """The newest token's text, from the decoded context window without and with it."""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def step(self, token_id: int) -> bool:
        """Add a token; True if a stop string appeared (the text is cut before it, or after it
        with `include_stop`)."""
        return step_all([self], [token_id])[0]

    @property
    def streams_bytes(self) -> bool:
        """Decoding is bytes and no stop string is looked for: each token's text is known at once
        and nothing is held back (stream_step)."""
        return self.bytes is not None and not self.stop

    def stream_step(self, token_id: int) -> str:
        """Where streams_bytes: step(token_id) and take(False) in one (the common stream, its
        text never kept: nothing is held back, so take() would hand it all over at once). Such a
        stream keeps only its pending bytes and `emitted`: no window of ids (its text is its
        bytes decoded, take(True) flushes what is pending), no `dropped`."""
        table, skip = self.bytes, self.skip_special_tokens
        if not self.pending:  # (nearly every token: its text whole after whole characters, a lookup)
            text = table.texts[skip].get(token_id, _UNSEEN)
            if text is _UNSEEN:
                text = table.text_of(token_id, skip)
            if text is not None:
                self.emitted += len(text)
                return text
        b = (table.skipping if skip else table.keeping).get(token_id)
        pending = self.pending + (b if b is not None else table.of(token_id, skip))
        text = pending.decode("utf-8", "replace")
        if not text or text[-1] == "\ufffd":  # a character still incomplete: wait
            self.pending = pending
            return ""
        self.pending = b""
        self.emitted += len(text)
        return text

    def _add_text(self, text: str) -> bool:
        """The tokens since the last text (the newest appended to `ids`) add `text`, whole
        characters: what _advance does when the window's texts differ by `text`."""
        before = len(self.text)
        self.text += text
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.pending = b""
        return self._check_stop(before) if self.stop else False

    def _advance(self, prefix: str, full: str) -> bool:
        """After the token was appended to `ids`: its text in, the stop strings checked."""
        before = len(self.text)
        self._emit(prefix, full)
        return self._check_stop(before) if self.stop else False

    def _check_stop(self, before: int) -> bool:
        """Whether a stop string appeared in the text added after `before` (the text is cut)."""
        if len(self.text) > before:
            start = max(0, before - self.holdback)
            hits = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                at, n = min(hits)
                self.text = self.text[:at + (n if self.include_stop else 0)]
                self.stopped = True
                return True
        return False

    def take(self, final: bool) -> str:
        """The text not yet emitted; while not final, keep the stop-string holdback. The
        final take also flushes undecodable trailing bytes (as U+FFFD, as `decode` would)."""
        if self.streams_bytes:  # (see stream_step)
            text, self.text = self.text, ""  # (what decoding by windows left, before the stream began)
            if final and self.pending:  # undecodable trailing bytes, as U+FFFD
                text += self.pending.decode("utf-8", "replace")
                self.pending = b""
            self.emitted += len(text)
            return text
        if final and not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.ids)
            self.pending = b""
        start = self.emitted - self.dropped
        end = max(start, len(self.text) if final else len(self.text) - self.holdback)
        delta = self.text[start:end]
        self.emitted = self.dropped + end
        cut = min(end, len(self.text))  # what is emitted is never read again (stop strings are
        if cut:                          # looked for after it): let go
            self.text = self.text[cut:]
            self.dropped += cut
        return delta
