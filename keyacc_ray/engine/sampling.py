"""Token sampling. Greedy rows take a batched argmax; sampled rows each use their own CPU
generator, so a seeded request draws the same tokens whatever else is in the batch and on
whichever device its logits were computed; the generator state travels in a KV package."""
from __future__ import annotations

import random

import numpy as np
import torch

from keyacc_ray.engine.request import SamplingParams


class Sampler:
    def __init__(self):
        self._gens: dict[str, torch.Generator] = {}
        # request id -> (history length covered, its distinct token ids, them as a tensor): kept up
        # to date as the history grows, for the repetition penalty (rebuilt from the whole
        # history every step, it cost about 0.6 ms a row at 1000 tokens)
        self._seen: dict[str, tuple[int, set, torch.Tensor]] = {}

    def add(self, request_id: str, params: SamplingParams, state: np.ndarray | None = None) -> None:
        g = torch.Generator(device="cpu")
        if state is not None:
            g.set_state(torch.tensor(np.asarray(state, dtype=np.uint8)))  # a copy: object-store views are read-only
        else:
            seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
            g.manual_seed(seed % 2**64)
        self._gens[request_id] = g

    def remove(self, request_id: str) -> None:
        self._gens.pop(request_id, None)
        self._seen.pop(request_id, None)

    def _distinct(self, request_id: str, tokens: list[int], device) -> torch.Tensor:
        """The distinct ids in `tokens` (a history that only grows), updated from the new ones."""
        covered, ids, t = self._seen.get(request_id) or (0, set(), torch.empty(0, dtype=torch.long, device=device))
        if covered > len(tokens):  # not this history: start again
            covered, ids, t = 0, set(), torch.empty(0, dtype=torch.long, device=device)
        new = sorted({x for x in tokens[covered:] if x not in ids})
        if new:
            ids.update(new)
            t = torch.cat([t, torch.tensor(new, device=device)])
        self._seen[request_id] = (len(tokens), ids, t)
        return t

    def state(self, request_id: str) -> np.ndarray:
        return self._gens[request_id].get_state().numpy().copy()

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               history=None) -> list[int]:
        """logits: [B, vocab] on any device; returns one token id per row. `history(row)` gives a
        row's (token ids so far, number of prompt tokens, end-of-sequence ids), read only for rows
        whose logits are processed (penalties, logit bias, min_tokens)."""
        out = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            row = logits[i]
            if p.processes_logits:
                tokens, num_prompt, eos_ids = history(i)
                seen = self._distinct(request_ids[i], tokens, row.device) if p.repetition_penalty != 1.0 else None
                row = process_logits(row.float(), tokens, num_prompt, p, eos_ids, seen)
                if p.greedy:
                    out[i] = int(row.argmax())
            if not p.greedy:
                out[i] = self._sample_row(row.float(), p, self._gens[request_ids[i]])
        return out

    @staticmethod
    def logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int], ranks: bool = False) -> list[tuple]:
        """For each row: (log-probability of token_ids[row], [(id, logprob) of its num_top[row]
        most likely tokens]), under the model's own distribution (log-softmax of the raw logits);
        with `ranks`, a third element: token_ids[row]'s rank in it (1: the most likely)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen_t = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])
        chosen = chosen_t[:, 0].tolist()
        top_v, top_i = lp.topk(max(num_top), dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out = [(chosen[r], list(zip(top_i[r][:n], top_v[r][:n]))) for r, n in enumerate(num_top)]
        if ranks:
            rank = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
            out = [(*e, rank[r]) for r, e in enumerate(out)]
        return out

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
        """One token from a row of logits (any device): temperature, top-k, min-p, top-p, then one
        uniform draw from the request's own generator on CPU, inverted through the cumulative
        distribution (torch.multinomial and a full sort each cost tens of milliseconds on a
        150k-token vocabulary on CPU; this costs well under one). Only candidates are carried:
        with top-k, the tokens scoring at least the k-th (ties kept, in token-id order, so the
        draw is the same on any device); with top-p, the most likely tokens up to its mass."""
        ids = None  # token id of each candidate; None: every token, in order
        if p.top_k and 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            ids = torch.nonzero(row >= kth).flatten()
            row, ids = row[ids], ids.cpu()
        probs = torch.softmax(row.cpu() / p.temperature, dim=-1)
        if p.min_p > 0.0:  # relative to the most likely token, after temperature and top-k (as vLLM)
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        if p.top_p < 1.0:
            top, order = _top_mass(probs, p.top_p)
            keep = torch.cumsum(top, dim=-1) - top < p.top_p
            keep[0] = True
            probs, order = top[keep], order[keep]
            ids = order if ids is None else ids[order]
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        u = torch.rand((), generator=g, dtype=torch.float64) * cdf[-1]
        choice = min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)
        return choice if ids is None else int(ids[choice])


def _top_mass(probs: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely entries of `probs`, in descending order (values, indices), enough of them
    to hold at least `mass` (all of them if need be): a top-k that widens, instead of sorting a
    whole vocabulary for the few hundred tokens that usually hold the mass."""
    k = min(probs.numel(), 256)
    while True:
        top, order = torch.topk(probs, k)
        if k == probs.numel() or float(top.sum()) >= mass:
            return top, order
        k = min(probs.numel(), k * 8)


def process_logits(row: torch.Tensor, token_ids: list[int], num_prompt: int, p: SamplingParams,
                   eos_ids=(), seen: torch.Tensor | None = None) -> torch.Tensor:
    """One row of float logits with the request's processing applied (a new tensor), in vLLM's and
    transformers' order: the logit bias, the repetition penalty over prompt and output
    (transformers' RepetitionPenaltyLogitsProcessor), then presence and frequency penalties over
    the output (OpenAI's formula, as vLLM applies them); before `min_tokens` outputs, the tokens
    that would end the sequence (`eos_ids` unless ignore_eos, stop token ids) are ruled out.
    `seen`: the distinct ids of token_ids, where the caller keeps them (else computed here)."""
    row = row.clone()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
    if p.repetition_penalty != 1.0 and token_ids:
        if seen is None:
            seen = torch.tensor(sorted(set(token_ids)), device=row.device)
        score = row[seen]
        row[seen] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(token_ids) > num_prompt:
        ids, counts = torch.tensor(token_ids[num_prompt:], device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    if len(token_ids) - num_prompt < p.min_tokens:
        enders = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        if enders:
            row[torch.tensor(sorted(enders), device=row.device)] = float("-inf")
    return row
