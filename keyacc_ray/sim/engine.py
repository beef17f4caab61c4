"""One simulated engine replica: the real Scheduler and BlockManager (keyacc_ray/engine), so
admission, chunked prefill, lazy or reserved KV blocks and preemption are the engine's own; a
step takes the time its device's StepTime model says instead of running a model. What
LLMEngine.step does around the forward is mirrored here: prompt chunks and decode rows advance,
rows whose prompt is complete get a token, a preempted sequence either leaves with its KV
(`movable`) or is recomputed, a finished one leaves."""
from __future__ import annotations

from dataclasses import dataclass, field

from keyacc_ray.engine.blocks import BlockManager
from keyacc_ray.engine.request import SamplingParams, Sequence, SeqStatus
from keyacc_ray.engine.scheduler import PrefillRate, Scheduler
from keyacc_ray.sim.steptime import StepTime, attention_pairs


@dataclass
class StepResult:
    seconds: float
    produced: list[Sequence] = field(default_factory=list)  # a token each (appended)
    preempted_out: list[Sequence] = field(default_factory=list)  # movable ones that lost their blocks
    prefill_tokens: int = 0
    decode_rows: int = 0


class SimEngine:
    def __init__(self, name: str, deployment: str, pool: str, steptime: StepTime, max_num_seqs: int,
                 num_blocks: int, block_size: int = 16, max_prefill_tokens: int = 4096, lazy: bool = True,
                 max_waiting: int = 1024, max_model_len: int = 1 << 20, per_token_s: float = 0.0,
                 growth_reserve: bool = False, under_way: int = 0, own_cores: float = 0.0):
        self.name, self.deployment, self.pool, self.steptime = name, deployment, pool, steptime
        self.per_token_s = per_token_s  # the replica's CPU per token beyond the step (PoolSpec.pool_s_per_token)
        self.own_cores = own_cores  # the replica's other threads' share of the engine's core (PoolSpec.own_cores)
        self.stack_share = 0.0  # the serving stack's share of that core now (its server sets it before a step)
        self.move_cores = 0.0  # its own threads' extra share for the requests moving now (PoolSpec.own_s_per_move)
        self.corun = 1.0  # its steps' cost beside the other pool's engine (PoolSpec.corun_factor), set likewise
        per_seq = min(num_blocks, -(-max_model_len // block_size))
        self.blocks = BlockManager(num_blocks, block_size, 0, per_seq)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_waiting, max_prefill_tokens, lazy=lazy,
                                   growth_reserve=growth_reserve, under_way=under_way)
        self.max_num_seqs = max_num_seqs
        self.seqs: dict[str, Sequence] = {}
        self.movable: set[str] = set()
        self.busy = False
        self.tokens_generated = 0
        self.busy_s = 0.0
        self.recent: list[tuple[float, int]] = []  # (time, tokens) of recent steps: tokens/s for reports
        self.prefill_rate = PrefillRate(max_step_tokens=max_prefill_tokens)  # as LLMEngine measures it

    def add(self, rid: str, prompt_len: int, generated: int, max_tokens: int, with_kv: bool,
            movable: bool = False) -> bool:
        """A sequence arrives: a new prompt, or (with_kv) a hand-off holding KV for every token but
        the last. False: the waiting queue is full (backpressure)."""
        tokens = [1] * prompt_len + [2] * generated
        seq = Sequence(rid, tokens, prompt_len, SamplingParams(max_tokens=max_tokens))
        if with_kv:
            seq.num_cached = len(tokens) - 1
        if not self.scheduler.add(seq):
            return False
        self.seqs[rid] = seq
        if movable:
            self.movable.add(rid)
        return True

    def remove(self, rid: str, status: SeqStatus = SeqStatus.FINISHED_EXPORTED) -> None:
        seq = self.seqs.pop(rid, None)
        self.movable.discard(rid)
        if seq is not None:
            self.scheduler.finish(seq, status)

    def waiting_unstarted(self) -> list[str]:
        """Sequences queued here that never ran (no KV brought, nothing generated here)."""
        return [s.request_id for s in self.scheduler.waiting if s.num_cached == 0 and s.status == SeqStatus.WAITING]

    def step(self) -> StepResult | None:
        """Schedule one step (None: nothing to run); its effects are applied now, its time is
        what the caller waits before the next one."""
        sched = self.scheduler.schedule()
        out = StepResult(0.0)
        for s in sched.preempted:
            if s.request_id in self.movable:  # leaves with its KV (intact this step)
                self.seqs.pop(s.request_id, None)
                self.movable.discard(s.request_id)
                self.scheduler.finish(s, SeqStatus.FINISHED_EXPORTED)
                out.preempted_out.append(s)
            else:
                s.num_cached = 0  # recomputed when readmitted
        kv = attn = 0
        for s in sched.decode:
            kv += s.num_cached
            s.num_cached += 1
            s.token_ids.append(2)
            out.produced.append(s)
        for s, n in sched.prefill:
            attn += attention_pairs(n, s.num_cached)
            s.num_cached += n
            out.prefill_tokens += n
            if s.num_cached == s.num_tokens:
                s.token_ids.append(2)
                out.produced.append(s)
        if not sched.decode and not sched.prefill:
            return None if not out.preempted_out else out
        out.decode_rows = len(sched.decode)
        out.seconds = self.steptime.seconds(out.prefill_tokens, out.decode_rows, kv, attn)
        self.prefill_rate.observe(out.prefill_tokens, out.seconds)
        out.seconds += len(out.produced) * self.per_token_s
        out.seconds *= self.corun
        # what the engine thread gets of its core: less the replica's own threads and the stack's
        # share, each in cores as the real run's accounting measures them (so they add: a stack
        # share of 0.26 beside own threads of 0.07 leaves 0.67 of the core, not 0.74 x 0.93)
        out.seconds /= max(0.1, 1 - self.own_cores - self.move_cores - self.stack_share)
        self.tokens_generated += len(out.produced)
        return out

    # ---- load reports --------------------------------------------------------------------
    def tokens_per_s(self, now: float, window_s: float = 2.0) -> float:
        self.recent = [(t, n) for t, n in self.recent if now - t <= window_s]
        return sum(n for _, n in self.recent) / window_s

    def report(self, now: float):
        from keyacc_ray.serve.monitor import ReplicaReport

        return ReplicaReport(self.deployment, self.pool, "whole" if self.pool == "cpu" else "decode", self.name,
                             self.scheduler.num_waiting, self.scheduler.num_running, self.blocks.num_free_blocks,
                             self.blocks.num_blocks, self.blocks.block_size, self.max_num_seqs,
                             self.tokens_per_s(now), self.tokens_generated, False, self.pool,
                             num_preemptions=self.scheduler.num_preemptions,
                             prefill_tokens_per_s=round(self.prefill_rate.tokens_per_s, 1),
                             max_waiting=self.scheduler.max_waiting)
