"""Iteration-level continuous batching. No torch.

Each step: every running sequence decodes one token in one batched forward; then waiting
sequences are admitted first-come-first-served while a slot and their KV blocks are free (and
the step's prefill-token budget lasts), and are prefilled. A sequence that does not fit waits;
the waiting queue itself is bounded.

KV blocks ("reserve" or "lazy", see blocks.py): reserved for prompt + max_tokens at admission,
or taken for the tokens a sequence holds and grown each step. Lazy, a running sequence that
cannot grow makes the newest running sequence give up its blocks and slot (vLLM's recompute
preemption): it goes back to the head of the queue and, readmitted, prefills its prompt and the
tokens it has generated again, then goes on as if nothing happened. No admission in a step that
preempted.
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
    preempted: list[Sequence] = field(default_factory=list)  # lazy KV: lost their blocks, queued again


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_waiting: int,
                 max_prefill_tokens: int, lazy: bool = False):
        self.blocks = blocks
        self.lazy = lazy
        self.num_preemptions = 0
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
        out = SchedulerOutput()
        if self.lazy:
            self._grow_running(out)
        out.decode = list(self.running)
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if out.admitted and seq.num_pending > budget:
                break
            if not self.blocks.allocate(seq.request_id, seq.num_tokens if self.lazy else seq.max_total_tokens):
                break  # FCFS: the head waits for blocks; nothing overtakes it
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            budget -= seq.num_pending
        return out

    def _grow_running(self, out: SchedulerOutput) -> None:
        """Blocks for every running sequence's next token, oldest first; where none are left, the
        newest running sequence is preempted (possibly the one that needed them)."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self.blocks.grow(seq.request_id, seq.num_tokens):
                i += 1
                continue
            victim = self.running.pop()
            self.blocks.free(victim.request_id)
            victim.status = SeqStatus.WAITING
            self.waiting.appendleft(victim)
            out.preempted.append(victim)
            self.num_preemptions += 1

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
