"""Iteration-level continuous batching. No torch.

Each step: every running sequence decodes one token, or feeds the next chunk of its prompt
(chunked prefill: at most `max_prefill_tokens` prompt tokens a step in all); then waiting
sequences are admitted first-come-first-served while a slot, their KV blocks and the step's
prompt-token budget last; sequences whose stream is under way (hand-offs) queue ahead of fresh
prompts. All of it runs in one forward. A sequence that does not fit waits;
the waiting queue itself is bounded.

KV blocks ("reserve" or "lazy", see blocks.py): reserved for prompt + max_tokens at admission,
or taken for the tokens a sequence holds and grown each step. Lazy, a running sequence that
cannot grow makes the newest running sequence give up its blocks and slot (vLLM's recompute
preemption): it goes back to the head of the queue and, readmitted, prefills its prompt and the
tokens it has generated again, then goes on as if nothing happened. No admission in a step that
preempted.

Prefix caching (blocks.py): an admitted sequence shares the cached blocks its tokens begin with
and prefills from the first block that is not cached (at least its last token is computed: its
logits give the next token). A sequence whose first uncached block is being computed this step
by another sequence's prompt chunk (the choices of an `n > 1` request, a batch of prompts with a
common head) waits one step and then shares it: one prefill of a common prefix. Past the blocks
cached on the device, blocks held in a lower tier (tiers.py: host memory, disk) are loaded into
new blocks where that is cheaper than computing them.

Holding prompts back (vLLM v0's scheduler delay factor): where a step of decode rows alone is much
cheaper than one with prompt tokens (CUDA graphs replay the former; the latter runs eagerly), the
engine sets `hold_until` after a step with prompt tokens, and until then fresh prompts are not
admitted while sequences are decoding: prompts arriving meanwhile are prefilled together in one
eager step instead of each making one. Hand-offs (they come with their KV: decode rows) and the
next chunks of prompts already admitted are never held; with nothing decoding nothing waits.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from keyacc_ray.engine.blocks import BlockManager, chain_hashes
from keyacc_ray.engine.request import Sequence, SeqStatus


@dataclass
class SchedulerOutput:
    decode: list[Sequence] = field(default_factory=list)  # one pending token each, batched
    # prompt chunks: (sequence, tokens this step), running ones first, then the admitted
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # new this step (in decode or prefill)
    preempted: list[Sequence] = field(default_factory=list)  # lazy KV: lost their blocks, queued again
    preempted_tables: dict[str, list[int]] = field(default_factory=dict)  # their blocks (KV intact this step)


class GrowthReserve:
    """Lazy KV admission with room to grow (SGLang's new-token ratio). Admitting while a
    sequence's own blocks fit fills the pool, and the running sequences' next tokens then preempt
    the newest, whose client waits mid-stream while it is computed again (under overload, step
    after step). Here a sequence is admitted only while the free blocks left also hold `ratio` of
    the tokens every running sequence (and it) may still generate (at most CLIP_TOKENS each). The
    ratio starts at INIT, falls by DECAY a step towards MIN while nothing is preempted (requests
    end before max_tokens), and is back at INIT after a preemption. With nothing running a
    sequence is always admitted."""

    INIT, MIN = 0.7, 0.1
    DECAY = (INIT - MIN) / 600
    CLIP_TOKENS = 4096

    def __init__(self):
        self.ratio = self.INIT
        self.refused = 0  # admissions put off for the room running sequences may need

    def need(self, seq: Sequence, held_blocks: int, blocks: BlockManager) -> int:
        """Blocks beyond `held_blocks` for `ratio` of what `seq` may still generate."""
        more = min(seq.max_total_tokens - seq.num_tokens, self.CLIP_TOKENS)
        return max(0, blocks.blocks_for(seq.num_tokens + int(self.ratio * more)) - held_blocks)

    def stepped(self, preempted: bool) -> None:
        self.ratio = self.INIT if preempted else max(self.MIN, self.ratio - self.DECAY)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_waiting: int,
                 max_prefill_tokens: int, lazy: bool = False, clock=time.monotonic, growth_reserve: bool = False,
                 under_way: int = 0):
        self.blocks = blocks
        self.lazy = lazy
        self.growth = GrowthReserve() if lazy and growth_reserve else None
        self.num_preemptions = 0
        self.max_num_seqs = max_num_seqs
        self.under_way = under_way  # places past max_num_seqs for streams under way (EngineConfig)
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lower = None  # tiers.LowerTiers below the device's cached blocks, if any
        self.clock = clock
        self.hold_until = 0.0  # fresh prompts wait while sequences decode, until then (clock's time)
        self.num_held = 0  # steps in which a fresh prompt was held back
        # hand-offs admitted: tokens of their K/V found cached here (shared, not copied); tokens
        # computed again (their package left out blocks not cached here)
        self.import_cached_tokens = 0
        self.import_recomputed_tokens = 0

    def add(self, seq: Sequence) -> bool:
        """Queue a sequence; False if the waiting queue is full, for a fresh prompt only. One
        whose stream is under way (it has generated tokens: a hand-off from another engine, a
        recovery) is never refused: the server admitted it already and its client has tokens (a
        refusal cut the stream with an error: the 2x soak's `cut_after_tokens`); how many there
        are is bounded by the streams admitted, not by this queue. It queues ahead of every fresh
        prompt, behind the others under way (as vLLM resumes preempted and swapped requests
        before new ones): its client is waiting between two tokens, a fresh prompt's for its first."""
        if len(self.waiting) >= self.max_waiting and not seq.num_output_tokens:
            return False
        if seq.num_output_tokens:
            at = next((i for i, w in enumerate(self.waiting) if not w.num_output_tokens), len(self.waiting))
            self.waiting.insert(at, seq)
        else:
            self.waiting.append(seq)
        return True

    def fits_ever(self, seq: Sequence) -> bool:
        return self.blocks.can_ever_allocate(seq.max_total_tokens)

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        n = min(seq.num_pending, budget)
        return min(n, seq.max_chunk) if seq.max_chunk else n

    def schedule(self) -> SchedulerOutput:
        """Running sequences first (oldest first): a decode row each, or the next chunk of a
        prompt within the step's prefill-token budget; then waiting ones, first come first
        served, while a slot, blocks and budget last (a prompt longer than what is left of the
        budget starts with a chunk of it)."""
        out = SchedulerOutput()
        budget = self.max_prefill_tokens
        tables, bs, lazy = self.blocks.tables, self.blocks.block_size, self.lazy
        running, decoding = self.running, out.decode
        i = 0
        while i < len(running):
            seq = running[i]
            cached = seq.num_cached
            decode = cached > 0 and len(seq.token_ids) - cached == 1  # (Sequence.decoding, inline)
            n = 1 if decode else self._chunk(seq, budget)
            if n == 0:  # the budget is spent: this prompt goes on next step
                i += 1
                continue
            if (lazy and cached + n > len(tables[seq.request_id]) * bs
                    and not self.blocks.grow(seq.request_id, cached + n)):
                self._preempt_newest(out)  # possibly seq itself; then the loop ends here
                continue
            if decode:
                decoding.append(seq)
            else:
                out.prefill.append((seq, n))
                budget -= n
            i += 1
        caching = self.blocks.prefix_caching
        pending = self._pending(out.prefill) if caching and self.waiting else None
        hold = bool(decoding) and self.hold_until > 0 and self.clock() < self.hold_until
        growth = self.growth
        if growth is not None:
            growth.stepped(bool(out.preempted))
            room = sum(growth.need(s, len(tables[s.request_id]), self.blocks) for s in running) \
                if self.waiting else 0
        while self.waiting and not out.preempted:
            seq = self.waiting[0]
            # a stream under way (queued ahead of every fresh prompt) may take a place past
            # max_num_seqs, up to `under_way` more; a fresh prompt waits for one within it
            if len(self.running) >= self.max_num_seqs + (self.under_way if seq.num_output_tokens else 0):
                break
            decode = seq.decoding  # came with its KV (a hand-off)
            if hold and not decode:  # a fresh prompt (or a recomputation) waits for the others
                self.num_held += 1
                break
            shared: list = []
            loads: list = []
            imp, cached_before, recompute = seq.imported, seq.num_cached, False
            if imp is not None and (imp.meta.kv_start or (pending is not None and seq.share_prefix)):
                # a hand-off with its KV: the head this engine caches is shared, its bytes in the
                # package not copied (and a package may leave them out: kv_start); one that left out
                # blocks not cached here is computed again from what is (its package dropped)
                if pending is not None and seq.share_prefix:
                    shared, loads = self._shared_prefix(seq, set(), cached_before // bs)
                have = (len(shared) + len(loads)) * bs
                recompute = have < imp.meta.kv_start
                if recompute:
                    seq.num_cached, decode = have, False
            elif pending is not None and seq.num_cached == 0 and seq.share_prefix:
                got = self._shared_prefix(seq, pending)
                if got is None:
                    break  # its next block is being computed this step: next step it shares it
                shared, loads = got
                seq.num_cached = (len(shared) + len(loads)) * bs
            n = 1 if decode else self._chunk(seq, budget)
            # lazy: blocks for every token it holds (a prompt's later chunks included, so that
            # prompts admitted together never preempt each other halfway through their prefill);
            # reserve: for all it may generate too
            want = seq.num_tokens if self.lazy else seq.max_total_tokens
            if growth is not None and self.running:  # and room for it and the others to grow
                own = self.blocks.blocks_taken(want, shared)
                more = growth.need(seq, self.blocks.blocks_for(want), self.blocks)
                if self.blocks.num_free_blocks - own < room + more:
                    growth.refused += 1
                    seq.num_cached = cached_before
                    break
            if n == 0 or not self.blocks.allocate(seq.request_id, want, shared):
                seq.num_cached = cached_before
                break  # FCFS: the head waits for budget or blocks; nothing overtakes it
            if growth is not None:
                room += growth.need(seq, self.blocks.blocks_for(want), self.blocks)
            if imp is not None:
                have = (len(shared) + len(loads)) * bs
                if recompute:
                    seq.imported = None
                    self.import_recomputed_tokens += cached_before - have
                else:  # its package goes into the blocks past the shared head
                    seq.kv_from = have
                    self.import_cached_tokens += have
            if loads:  # copied into its new blocks before the forward
                self.lower.load(loads, tables[seq.request_id][len(shared):len(shared) + len(loads)])
            if pending is not None and seq.share_prefix and not decode:
                self.blocks.queries += seq.num_tokens
                self.blocks.hits += len(shared) * bs  # (on the device; lower tiers count their own)
                if seq.num_output_tokens == 0:
                    seq.num_cached_prompt_tokens = seq.num_cached
                pending.update(seq.block_hashes[len(shared):(seq.num_cached + n) // bs])
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            if decode:
                out.decode.append(seq)
            else:
                out.prefill.append((seq, n))
                budget -= n
        return out

    def _pending(self, prefill: list[tuple[Sequence, int]]) -> set[bytes]:
        """Keys of the blocks this step's prompt chunks fill."""
        bs, keys = self.blocks.block_size, set()
        for seq, n in prefill:
            hashes = chain_hashes(seq.block_hashes, seq.token_ids, bs)
            keys.update(hashes[seq.num_cached // bs:(seq.num_cached + n) // bs])
        return keys

    def _shared_prefix(self, seq: Sequence, pending: set[bytes],
                       limit: int | None = None) -> tuple[list[bytes], list] | None:
        """Keys of the cached blocks the sequence begins with, and the (tier, key) of the blocks
        after them to load from a lower tier (at most `limit` blocks; by default leaving at least
        its last token to compute); None where its first block not found is being filled this step."""
        bs = self.blocks.block_size
        hashes = chain_hashes(seq.block_hashes, seq.token_ids, bs)
        limit = (seq.num_tokens - 1) // bs if limit is None else limit
        k = self.blocks.cached_prefix(hashes, limit)
        if k < limit and hashes[k] in pending:
            return None
        loads = self.lower.find(hashes[k:limit]) if self.lower is not None and k < limit else []
        m = k + len(loads)
        if m < limit and hashes[m] in pending:
            return None
        return hashes[:k], loads

    def _preempt_newest(self, out: SchedulerOutput) -> None:
        victim = self.running.pop()
        out.preempted_tables[victim.request_id] = self.blocks.block_table(victim.request_id)
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


class PrefillRate:
    """How fast prompts go through an engine lately: prompt tokens a second of the steps with
    MIN_TOKENS or more of them (decode rows sharing those steps included: what a prompt sent
    there meets), smoothed. 0 until measured. The router's policies read it (LLMEngine and the
    simulator's SimEngine keep one each). An engine whose steps take fewer prompt tokens than
    that (`max_prefill_tokens` below MIN_TOKENS: a slow CPU pool's chunk) measures its full
    chunks: left at 32, such a pool never had a rate, and the policies, reading "unknown" as "no
    limit", kept sending it whole requests whose prompts took minutes there."""

    MIN_TOKENS = 32

    def __init__(self, min_tokens: int = MIN_TOKENS, max_step_tokens: int | None = None):
        self.min_tokens = min(min_tokens, max_step_tokens) if max_step_tokens else min_tokens
        self.tokens_per_s = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens >= self.min_tokens and seconds > 0:
            rate, old = tokens / seconds, self.tokens_per_s
            self.tokens_per_s = rate if not old else 0.8 * old + 0.2 * rate
