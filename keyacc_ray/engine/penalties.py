"""Penalties, logit bias and min_tokens for a batch's rows at once.

Each request's history is kept as it grows (`History`: the distinct ids of prompt and output, and
the output's distinct ids with their counts where a frequency penalty reads them, in numpy arrays
with room to grow), so a step reads only the tokens that are new since the last one. What a
batch's rows ask for is sorted out once per batch (`Adjustments`, kept with the sampler's plan);
each step's adjustments are then a few flat index operations over the batch's logits, stage by
stage, in vLLM's and transformers' order:
1. OpenAI's logit bias, added;
2. the repetition penalty over prompt and output (transformers' RepetitionPenaltyLogitsProcessor:
   a logit divided by it where positive, multiplied where negative; rows grouped by their penalty,
   so each group is the same scalar operation transformers makes, on any device);
3. the presence and frequency penalties over the output (OpenAI's formula, as vLLM applies
   them): logit -= frequency x count + presence, in float32;
4. before `min_tokens` outputs, the tokens that would end the sequence at -inf.
Rows are independent, so a row's logits come out as if processed alone (`process_logits`, the
one-row form, is the same code).
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from keyacc_ray.engine.request import SamplingParams


class Distinct:
    """The distinct ids of a growing list of tokens, in first-seen order, and (`counts`: where
    asked for) each one's count."""

    __slots__ = ("slot", "ids", "counts", "n")

    def __init__(self, counts: bool = True):
        self.slot: dict[int, int] = {}
        self.ids = np.empty(16, dtype=np.int64)
        self.counts = np.zeros(16, dtype=np.float32) if counts else None
        self.n = 0

    def add(self, tokens) -> None:
        slot, ids, counts = self.slot, self.ids, self.counts
        for t in tokens:
            j = slot.get(t)
            if j is None:
                j = slot[t] = self.n
                if j == len(ids):  # room for twice as many
                    ids = self.ids = np.concatenate([ids, np.empty(j, dtype=np.int64)])
                    if counts is not None:
                        counts = self.counts = np.concatenate([counts, np.zeros(j, dtype=np.float32)])
                ids[j] = t
                self.n = j + 1
            if counts is not None:
                counts[j] += 1

    def add_one(self, t: int) -> None:
        """add([t]) for one token (a decode step's)."""
        j = self.slot.get(t)
        if j is None:
            j = self.n
            if j == len(self.ids):
                self.add((t,))
                return
            self.slot[t] = j
            self.ids[j] = t
            self.n = j + 1
        if self.counts is not None:
            self.counts[j] += 1


class History:
    """What a request's penalties read of its tokens, kept up to date as they grow: `seen` (prompt
    and output, for the repetition penalty) and `out` (the output, for presence and frequency;
    counted only for a frequency penalty), each only where the request's parameters use it."""

    __slots__ = ("covered", "num_prompt", "seen", "out")

    def __init__(self):
        self.covered, self.num_prompt = 0, -1
        self.seen: Distinct | None = None
        self.out: Distinct | None = None

    def update(self, tokens: list[int], num_prompt: int, p: SamplingParams) -> None:
        n, c = len(tokens), self.covered
        if n == c + 1 and num_prompt == self.num_prompt and c:  # a decode step's one new token
            t = tokens[c]
            if (d := self.seen) is not None:
                d.add_one(t)
            if (d := self.out) is not None and c >= num_prompt:
                d.add_one(t)
            self.covered = n
            return
        if c > n or num_prompt != self.num_prompt:  # not this history: start again
            c = self.covered = 0
            self.num_prompt = num_prompt
            self.seen = Distinct(counts=False) if p.repetition_penalty != 1.0 else None
            self.out = Distinct(counts=bool(p.frequency_penalty)) if p.presence_penalty or p.frequency_penalty else None
        if c == n:
            return
        if self.seen is not None:
            self.seen.add(tokens[c:])
        if self.out is not None:
            self.out.add(tokens[max(c, num_prompt):])
        self.covered = n


class Adjustments:
    """A batch's rows' adjustments (`rows[k]` by `params[k]`), what does not change from step to
    step made once: which rows have a logit bias (its indices and values), which a repetition
    penalty (grouped by its value), which presence / frequency penalties, which min_tokens (and
    the ids that would end them). Kept with the batch (sampling.py's plan): each step then reads
    only the histories."""

    def __init__(self, rows: list[int], params: list[SamplingParams], eos_ids):
        self.rows = rows
        bias = [(r, p.logit_bias) for r, p in zip(rows, params) if p.logit_bias]
        self.bias_rows = [r for r, _ in bias]
        self.bias_ids = [np.fromiter(lb, dtype=np.int64, count=len(lb)) for _, lb in bias]
        self.bias_vals = (torch.from_numpy(np.concatenate([np.fromiter(lb.values(), dtype=np.float32, count=len(lb))
                                                           for _, lb in bias])) if bias else None)
        self._bias_at: tuple | None = None  # (vocabulary, device, flat indices)
        self.rep: dict[float, tuple[list[int], list[int]]] = {}  # penalty -> (rows, positions k)
        for k, (r, p) in enumerate(zip(rows, params)):
            if p.repetition_penalty != 1.0:
                rr, ks = self.rep.get(p.repetition_penalty) or self.rep.setdefault(p.repetition_penalty, ([], []))
                rr.append(r)
                ks.append(k)
        pen = [k for k, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        self.pen = pen
        self.pen_rows = [rows[k] for k in pen]
        self.frequency = np.array([params[k].frequency_penalty for k in pen], dtype=np.float32)
        self.presence = np.array([params[k].presence_penalty for k in pen], dtype=np.float32)
        self.counted = bool(self.frequency.any())  # (presence alone needs no counts)
        self._rep_flat: dict[float, _FlatIds] = {}  # penalty -> its rows' seen ids as flat indices
        self._pen_flat: _FlatIds | None = None  # presence alone: the output ids and their values
        self.ends = []  # (position k, row, min_tokens, the ids that would end it)
        for k, (r, p) in enumerate(zip(rows, params)):
            if p.min_tokens:
                enders = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
                if enders:
                    self.ends.append((k, r, p.min_tokens, np.array(sorted(enders), dtype=np.int64)))

    def apply(self, logits: torch.Tensor, histories: list[History], kernels=None) -> None:
        """Adjust float32 `logits` [B, V] in place, each history up to date (`History.update`
        with its tokens so far); the indices and values made for all rows at once. `kernels`: the
        CPU kernels, whose penalize_at / subtract_at do the penalties' index operations on a CPU
        tensor in one pass (the same floats as the torch form)."""
        V, dev = logits.shape[1], logits.device
        flat = logits.view(-1)
        K = kernels if kernels is not None and dev.type == "cpu" and logits.is_contiguous() else None
        if self.bias_rows:
            at = self._bias_at
            if at is None or at[0] != V or at[1] != dev:
                at = self._bias_at = (V, dev, _index(self.bias_rows, self.bias_ids, V, dev))
            flat[at[2]] += self.bias_vals.to(dev)
        for penalty, (rr, ks) in self.rep.items():
            seen = [histories[k].seen for k in ks]
            f = self._rep_flat.get(penalty)
            if f is None or not f.update(seen, V):
                f = self._rep_flat[penalty] = _FlatIds(rr, seen, V)
            idx = torch.from_numpy(f.index()).to(dev)
            if K is not None:
                K.penalize_at(flat, idx, penalty)
            else:
                score = flat.index_select(0, idx)
                flat.index_copy_(0, idx, torch.where(score < 0, score * penalty, score / penalty))
        if self.pen:  # frequency x count + presence, in float32 (as torch makes it from the scalars)
            out = [histories[k].out for k in self.pen]
            if self.counted:  # (counts change every step: made again)
                ids = [d.ids[:d.n] for d in out]
                lens = _lengths(ids)
                v = np.repeat(self.presence, lens)
                v += np.repeat(self.frequency, lens) * np.concatenate(
                    [d.counts[:d.n] if d.counts is not None else np.zeros(d.n, dtype=np.float32) for d in out])
                idx, v = _index(self.pen_rows, ids, V, dev, lens), torch.from_numpy(v).to(dev)
            else:  # presence alone: each id's value is its row's, kept with the index
                f = self._pen_flat
                if f is None or not f.update(out, V):
                    f = self._pen_flat = _FlatIds(self.pen_rows, out, V, self.presence)
                idx, v = torch.from_numpy(f.index()).to(dev), torch.from_numpy(f.values()).to(dev)
            if K is not None:
                K.subtract_at(flat, idx, v)
            else:
                flat.index_copy_(0, idx, flat.index_select(0, idx) - v)
        ends = [(r, e) for k, r, m, e in self.ends if histories[k].covered - histories[k].num_prompt < m]
        if ends:
            flat[_index([r for r, _ in ends], [e for _, e in ends], V, dev)] = float("-inf")


def apply(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], histories: list[History],
          eos_ids) -> None:
    """Adjust float32 `logits` [B, V] in place: for each k, row rows[k] by params[k], whose
    history histories[k] is up to date (`History.update` with its tokens so far)."""
    Adjustments(rows, params, eos_ids).apply(logits, histories)


class _FlatIds:
    """The flat indices into [B, V] of some rows' distinct ids (row r's `Distinct`), kept while
    the batch holds: each step appends only the ids that are new since the last one (the ids are
    distinct per row, so the order of the indices does not matter). With `values` (one per row),
    each index's row value, kept beside it."""

    __slots__ = ("V", "base", "ds", "done", "buf", "vals", "row_vals", "n")

    def __init__(self, rows: list[int], ds: list[Distinct], V: int, values: np.ndarray | None = None):
        self.V, self.base = V, [r * V for r in rows]
        self.ds = list(ds)
        self.done = [0] * len(ds)
        self.buf = np.empty(max(1024, 2 * sum(d.n for d in ds)), dtype=np.int64)
        self.row_vals = values
        self.vals = np.empty(len(self.buf), dtype=np.float32) if values is not None else None
        self.n = 0
        self.update(ds, V, check=False)

    def update(self, ds: list[Distinct], V: int, check: bool = True) -> bool:
        """Append each row's new ids; False (nothing changed) where these are not the rows' same
        `Distinct`s over the same vocabulary: the caller makes a new one."""
        if check and (V != self.V or len(ds) != len(self.ds) or any(map(operator.is_not, ds, self.ds))):
            return False
        done, base = self.done, self.base
        one, one_rows, more = [], [], []  # (a step adds at most one id a row: appended as scalars)
        for j, d in enumerate(ds):
            m = d.n
            if m != done[j]:
                if m == done[j] + 1:
                    one.append(int(d.ids[m - 1]) + base[j])
                    one_rows.append(j)
                else:
                    more.append((d.ids[done[j]:m] + base[j], j))
                done[j] = m
        if one:
            self._append(np.array(one, dtype=np.int64), one_rows)
        for idx, j in more:
            self._append(idx, j)
        return True

    def _append(self, idx: np.ndarray, rows) -> None:
        """Append flat indices `idx` of row `rows` (an int, or one per index)."""
        n, m = self.n, len(idx)
        if n + m > len(self.buf):
            cap = 2 * (n + m)
            self.buf = np.concatenate([self.buf[:n], np.empty(cap - n, dtype=np.int64)])
            if self.vals is not None:
                self.vals = np.concatenate([self.vals[:n], np.empty(cap - n, dtype=np.float32)])
        self.buf[n:n + m] = idx
        if self.vals is not None:
            self.vals[n:n + m] = self.row_vals[rows]
        self.n = n + m

    def index(self) -> np.ndarray:
        return self.buf[:self.n]

    def values(self) -> np.ndarray:
        return self.vals[:self.n]


def _lengths(ids: list[np.ndarray]) -> np.ndarray:
    return np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))


def _index(rows: list[int], ids: list[np.ndarray], V: int, dev, lens: np.ndarray | None = None) -> torch.Tensor:
    """Flat indices into [B, V] of each row's ids, all rows at once."""
    if not ids:
        return torch.empty(0, dtype=torch.long, device=dev)
    base = np.repeat(np.array(rows, dtype=np.int64) * V, _lengths(ids) if lens is None else lens)
    return torch.from_numpy(np.concatenate(ids) + base).to(dev)


def process_logits(row: torch.Tensor, token_ids: list[int], num_prompt: int, p: SamplingParams,
                   eos_ids=()) -> torch.Tensor:
    """One row of logits with the request's processing applied (a new float32 tensor): `apply`
    for a batch of one, its history read from scratch."""
    x = row.float().clone()[None]
    h = History()
    h.update(token_ids, num_prompt, p)
    apply(x, [0], [p], [h], eos_ids)
    return x[0]
