"""What a step gives back per request, and the batch of rows the engine last sampled."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)  # one per row per step: slots halve its construction
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text: str  # new text, never a broken UTF-8 sequence
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # per new token, where the request asked for them: (logprob, [(id, logprob) alternatives])
    logprobs: list[tuple] | None = None
    # with the first token, where the request asked for them: per prompt token, (logprob,
    # alternatives) given the tokens before it; None for the first (nothing comes before it)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class DecodeBatch:
    """The rows the engine last sampled, in order: their sequences, request ids, sampling params,
    the rows that want logprobs, and the tokens drawn (the next step's inputs while the batch
    holds), and whether the batch is plain: no row's sampling reads the host (logprobs, penalties,
    a logit bias, min_tokens, a grammar), so its steps may be scheduled asynchronously."""

    __slots__ = ("seqs", "rids", "params", "want", "sampled", "plain")

    def __init__(self, seqs: list):
        self.seqs = list(seqs)
        self.rids = [s.request_id for s in seqs]
        self.params = [s.params for s in seqs]
        self.want = [i for i, p in enumerate(self.params) if p.logprobs is not None]
        self.sampled: np.ndarray | None = None
        self.plain = not self.want and not any(p.processes_logits for p in self.params)

    def same(self, seqs: list) -> bool:
        return len(self.seqs) == len(seqs) and all(map(operator.is_, self.seqs, seqs))
