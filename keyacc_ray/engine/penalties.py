"""Penalties, logit bias and min_tokens for a batch's rows at once.

Each request's history is kept as it grows (`History`: the distinct ids of prompt and output, and
the output's distinct ids with their counts, in numpy arrays with room to grow), so a step reads
only the tokens that are new since the last one. The rows' adjustments are then a few flat index
operations over the batch's logits, stage by stage, in vLLM's and transformers' order:
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

import numpy as np
import torch

from keyacc_ray.engine.request import SamplingParams


class Distinct:
    """The distinct ids of a growing list of tokens, in first-seen order, and each one's count."""

    __slots__ = ("slot", "ids", "counts", "n")

    def __init__(self):
        self.slot: dict[int, int] = {}
        self.ids = np.empty(16, dtype=np.int64)
        self.counts = np.zeros(16, dtype=np.float32)
        self.n = 0

    def add(self, tokens) -> None:
        slot, ids, counts = self.slot, self.ids, self.counts
        for t in tokens:
            j = slot.get(t)
            if j is None:
                j = slot[t] = self.n
                if j == len(ids):  # room for twice as many
                    ids = self.ids = np.concatenate([ids, np.empty(j, dtype=np.int64)])
                    counts = self.counts = np.concatenate([counts, np.zeros(j, dtype=np.float32)])
                ids[j] = t
                self.n = j + 1
            counts[j] += 1


class History:
    """What a request's penalties read of its tokens, kept up to date as they grow: `seen` (prompt
    and output, for the repetition penalty) and `out` (the output, for presence and frequency),
    each only where the request's parameters use it."""

    __slots__ = ("covered", "num_prompt", "seen", "out")

    def __init__(self):
        self.covered, self.num_prompt = 0, -1
        self.seen: Distinct | None = None
        self.out: Distinct | None = None

    def update(self, tokens: list[int], num_prompt: int, p: SamplingParams) -> None:
        if self.covered > len(tokens) or num_prompt != self.num_prompt:  # not this history: start again
            self.covered, self.num_prompt = 0, num_prompt
            self.seen = Distinct() if p.repetition_penalty != 1.0 else None
            self.out = Distinct() if p.presence_penalty or p.frequency_penalty else None
        c = self.covered
        if self.seen is not None:
            self.seen.add(tokens[c:])
        if self.out is not None:
            self.out.add(tokens[max(c, num_prompt):])
        self.covered = len(tokens)


def apply(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], histories: list[History],
          eos_ids) -> None:
    """Adjust float32 `logits` [B, V] in place: for each k, row rows[k] by params[k], whose
    history histories[k] is up to date (`History.update` with its tokens so far).
    Per row only views are gathered; the indices and values are made for all rows at once."""
    V, dev = logits.shape[1], logits.device
    flat = logits.view(-1)
    bias, ends = ([], [], []), ([], [])  # (rows, ids per row[, values per row])
    rep: dict[float, tuple[list, list]] = {}
    pen = ([], [], [], [], [])  # rows, ids, counts, frequency, presence
    for r, p, h in zip(rows, params, histories):
        if p.logit_bias:
            lb = p.logit_bias
            bias[0].append(r)
            bias[1].append(np.fromiter(lb, dtype=np.int64, count=len(lb)))
            bias[2].append(np.fromiter(lb.values(), dtype=np.float32, count=len(lb)))
        d = h.seen
        if d is not None and d.n:
            rr, ids = rep.get(p.repetition_penalty) or rep.setdefault(p.repetition_penalty, ([], []))
            rr.append(r)
            ids.append(d.ids[:d.n])
        d = h.out
        if d is not None and d.n:
            pen[0].append(r)
            pen[1].append(d.ids[:d.n])
            pen[2].append(d.counts[:d.n])
            pen[3].append(p.frequency_penalty)
            pen[4].append(p.presence_penalty)
        if h.covered - h.num_prompt < p.min_tokens:
            enders = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            if enders:
                ends[0].append(r)
                ends[1].append(np.array(sorted(enders), dtype=np.int64))
    if bias[0]:
        flat[_index(bias[0], bias[1], V, dev)] += torch.from_numpy(np.concatenate(bias[2])).to(dev)
    for penalty, (rr, ids) in rep.items():
        idx = _index(rr, ids, V, dev)
        score = flat[idx]
        flat[idx] = torch.where(score < 0, score * penalty, score / penalty)
    if pen[0]:  # frequency x count + presence, in float32 (as torch makes it from the scalars)
        lens = _lengths(pen[1])
        v = (np.repeat(np.array(pen[3], dtype=np.float32), lens) * np.concatenate(pen[2])
             + np.repeat(np.array(pen[4], dtype=np.float32), lens))
        flat[_index(pen[0], pen[1], V, dev, lens)] -= torch.from_numpy(v).to(dev)
    if ends[0]:
        flat[_index(ends[0], ends[1], V, dev)] = float("-inf")


def _lengths(ids: list[np.ndarray]) -> np.ndarray:
    return np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))


def _index(rows: list[int], ids: list[np.ndarray], V: int, dev, lens: np.ndarray | None = None) -> torch.Tensor:
    """Flat indices into [B, V] of each row's ids, all rows at once."""
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
