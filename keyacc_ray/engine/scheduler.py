"""Iteration-level continuous batching. No torch.

Each step: every running sequence decodes one token in one batched forward; then waiting
sequences are admitted first-come-first-served while a slot and their reserved KV blocks are
free (and the step's prefill-token budget lasts), and are prefilled. A sequence that does not
fit waits; the waiting queue itself is bounded.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from keyacc_ray.engine.blocks import BlockManager
from keyacc_ray.engine.request import Sequence, SeqStatus


@dataclass
class SchedulerOutput:
    decode: list[Sequence] = field(default_factory=list)  # one pending token each, batched
    admitted: list[Sequence] = field(default_factory=list)  # prefill / extend, one by one


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_waiting: int,
                 max_prefill_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> bool:
        """Queue a sequence; False if the waiting queue is full."""
        if len(self.waiting) >= self.max_waiting:
            return False
        self.waiting.append(seq)
        return True

    def fits_ever(self, seq: Sequence) -> bool:
        return self.blocks.can_ever_allocate(seq.max_total_tokens)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(decode=list(self.running))
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if out.admitted and seq.num_pending > budget:
                break
            if not self.blocks.allocate(seq.request_id, seq.max_total_tokens):
                break  # FCFS: the head waits for blocks; nothing overtakes it
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            budget -= seq.num_pending
        return out

    def finish(self, seq: Sequence, status: SeqStatus) -> None:
        assert status.finished, status
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.request_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
