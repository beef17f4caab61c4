"""Incremental detokenisation with stop strings.

Text is emitted only when the newest tokens decode to complete characters (no U+FFFD tail), so a
stream never carries a broken UTF-8 sequence; and the last `max_stop_len - 1` characters are
held back while a stop string could still be completing, so a stop string never leaks.
"""
from __future__ import annotations

CONTEXT_TOKENS = 6


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
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.stopped = False
        for t in output_ids:  # rebuild the state of a sequence imported mid-decode
            self._append(t)
        self.emitted = emitted_chars

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def step(self, token_id: int) -> bool:
        """Add a token; True if a stop string appeared (the text is cut before it, or after it
        with `include_stop`)."""
        before = len(self.text)
        self._append(token_id)
        if self.stop and len(self.text) > before:
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
        if final and not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.ids)
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
