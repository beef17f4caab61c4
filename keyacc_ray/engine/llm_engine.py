"""The engine loop: schedule, run, postprocess. Synchronous and Ray-free; a Serve replica
drives it from a background thread (see `keyacc_ray/serve/engine_loop.py`)."""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.blocks import BlockManager, chain_hashes
from keyacc_ray.engine.detok import IncrementalDetokenizer, step_all
from keyacc_ray.engine import kv_events
from keyacc_ray.engine.kv_events import ANCHOR_BLOCK, KVEvents
from keyacc_ray.engine.kv_package import KVMeta, KVPackage, check_span, dtype_name, to_engine_tensors, to_wire
from keyacc_ray.engine.postprocess import DecodeBatch, RequestOutput
from keyacc_ray.engine.request import SamplingParams, Sequence, SeqStatus
from keyacc_ray.engine.runner import ModelRunner, StepItem
from keyacc_ray.engine.sampling import HostCopy, Sampler
from keyacc_ray.engine.scheduler import PrefillRate, Scheduler
from keyacc_ray.engine.step_trace import StepTrace
from keyacc_ray.engine.structured import Grammars
from keyacc_ray.engine.tiers import LowerTiers
from keyacc_ray.errors import InvalidRequest, ModelLoadError, Overloaded
from keyacc_ray.histogram import ENGINE_HISTOGRAMS, Histogram

# Scoring a prompt (prompt logprobs) takes every position's logits: prefilled in chunks whose
# float32 logits stay under this (about 440 positions of a 151k vocabulary).
PROMPT_LOGITS_BYTES = 256 << 20

log = logging.getLogger(__name__)


def _two_digits(x: float | None) -> float:
    """A measured figure to two significant digits (0: not measured): a report changes when it
    moves, not at every copy."""
    return float(f"{x:.2g}") if x else 0.0


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    max_num_seqs: int
    tokens_generated: int
    device: str
    num_preemptions: int = 0  # lazy KV: sequences that gave up their blocks (recomputed later)
    # prefix cache: tokens looked up and found at admission (vLLM's names), blocks keyed, evicted
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_cached_blocks: int = 0
    prefix_cache_evictions: int = 0
    # lower tiers (host, disk): per tier the tokens found there, blocks loaded from / stored into it,
    # blocks held; blocks held below but computed again (cheaper than loading them)
    kv_tiers: dict | None = None
    histograms: dict | None = None  # histogram.ENGINE_HISTOGRAMS' names -> Histogram.to_dict()
    prefill_tokens_per_s: float = 0.0  # scheduler.PrefillRate: how fast prompts go through here lately
    steps_launched_ahead: int = 0  # asynchronous scheduling: decode steps launched before the last was read
    # hand-offs and the prefix cache: tokens whose K/V an export left out (the importer holds them),
    # tokens of imports found cached here on arrival (shared, not copied), tokens an import left out
    # that were not cached here (computed again)
    kv_export_skipped_tokens: int = 0
    kv_import_cached_tokens: int = 0
    kv_import_recomputed_tokens: int = 0
    max_waiting: int = 0  # the bound of its waiting queue: past it a fresh prompt is refused (503)


@dataclass(slots=True)
class Launched:
    """A decode step launched ahead and not read back yet (asynchronous scheduling): its rows,
    the positions they were fed at and their rows of the block array, the ids it sampled (on the
    device) and their copy to the host under way."""

    seqs: list[Sequence]
    pos: np.ndarray
    rows: np.ndarray
    ids: torch.Tensor
    copy: HostCopy


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None):
        from transformers import AutoTokenizer

        self.config = config
        self._step_trace = StepTrace.from_env()  # every step's rows, tokens and times, where asked for
        try:
            self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model,
                                                                        trust_remote_code=config.trust_remote_code)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot load tokenizer for {config.model!r}: {e}", param="model") from e
        self.runner = ModelRunner(config.model, config.dtype, config.device, config.max_num_seqs,
                                  config.max_model_len, config.num_threads, config.kv_memory_fraction,
                                  config.cpu_kernels, config.cpu_weight_quant,
                                  trust_remote_code=config.trust_remote_code, block_size=config.kv_block_size,
                                  num_kv_blocks=config.num_kv_blocks,
                                  gpu_memory_utilization=config.gpu_memory_utilization,
                                  max_num_batched_tokens=config.max_prefill_tokens,
                                  paged_attention=config.paged_attention, decode_graphs=config.decode_graphs)
        self.max_model_len = self.runner.max_model_len
        # The KV budget in blocks is the runner's block pool: the accounting is the memory.
        num_blocks = self.runner.num_blocks
        self.blocks = BlockManager(num_blocks, config.kv_block_size, config.max_num_seqs,
                                   self.runner.max_blocks_per_seq,
                                   prefix_caching=config.enable_prefix_caching)
        self.runner.block_array = self.blocks.array
        # The longest sequence this engine can ever hold is its KV budget (reserved at admission,
        # or grown to by a sequence running alone): the context it serves is no longer than that
        # (a client that leaves max_tokens out gets the rest of this context, which then fits).
        budget = num_blocks * config.kv_block_size
        if budget < self.max_model_len:
            log.warning("KV budget of %d blocks x %d tokens holds %d tokens, less than the model's context "
                        "of %d: serving a context of %d", num_blocks, config.kv_block_size, budget,
                        self.max_model_len, budget)
            self.max_model_len = budget
        # (CUDA graphs are captured up to max_num_seqs rows: no places past it there)
        under_way = 0 if self.runner.static_decode is not None else config.max_num_seqs_under_way
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_waiting,
                                   config.max_prefill_tokens, lazy=config.kv_allocation == "lazy",
                                   growth_reserve=config.kv_growth_reserve, under_way=under_way)
        self.tiers, self.kv_store = self._lower_tiers(config)
        self.kv_events = self._kv_events(config)
        f = config.prefill_delay_factor
        self.prefill_delay_factor = float(f if f is not None else (1.0 if self.runner.graphs_captured else 0.0))
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        eos = self.runner.hf_config.eos_token_id
        gen_eos = getattr(getattr(self.runner.model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = {e for x in (eos, gen_eos, self.tokenizer.eos_token_id) if x is not None
                        for e in (x if isinstance(x, (list, tuple)) else [x])}
        # the CPU kernels sample too, where built; grammars: structured outputs' token masks
        self.sampler = Sampler(self.runner.kernels, Grammars(self.tokenizer, self.runner.vocab_size, self.eos_ids))
        self.tokens_generated = 0
        # the rows last sampled (postprocess.DecodeBatch)
        self._batch: DecodeBatch | None = None
        # the last step's positions, block-array rows and row_changes, if it was decode rows alone
        self._last_decode: tuple | None = None
        self.prefill_rate = PrefillRate(max_step_tokens=config.max_prefill_tokens)
        # vLLM's queue / prefill / decode / inference times and tokens per step, as this engine sees them
        self.histograms = {name: Histogram(b) for name, (b, _) in ENGINE_HISTOGRAMS.items()}
        # Lazy KV: sequences that leave (exported, KV and all) when preempted instead of being
        # recomputed here; their packages wait in preempt_exports for the driver of the engine.
        # (request id -> the head its next engine likely caches: the export leaves its K/V out)
        self.move_on_preempt: dict[str, int] = {}
        self.preempt_exports: list[KVPackage] = []
        self._prompt_scores: dict[str, list] = {}  # prompt logprobs waiting for the first token's output
        # asynchronous scheduling: where decode steps run over the static buffers (decode_graphs)
        wanted = config.async_scheduling
        if wanted is None:  # (the default: where decode steps replay CUDA graphs, as vLLM's)
            wanted = bool(self.runner.graphs_captured)
        self.async_scheduling = wanted and self.runner.decodes_ahead
        if config.async_scheduling and not self.async_scheduling:
            log.warning("async_scheduling needs decode steps over static buffers (decode_graphs; on CPU the "
                        "fused step takes precedence): steps are scheduled synchronously")
        self._ahead: Launched | None = None  # the step launched ahead, not yet read back
        self._copies = HostCopy.ring()  # (this engine's pinned buffers for the sampled ids)
        self.steps_launched_ahead = 0
        self.kv_export_skipped_tokens = 0

    def _lower_tiers(self, config: EngineConfig):
        """Host, node and disk tiers under the block pool, where configured (with prefix caching)."""
        block_bytes = self.runner.kv_bytes_per_token() * config.kv_block_size
        host = int(config.kv_host_tier_gb * 2**30) // block_bytes
        disk = int(config.kv_disk_tier_gb * 2**30) // block_bytes
        node_bytes = int(config.kv_node_tier_gb * 2**30)
        if not config.enable_prefix_caching or not (host or disk or node_bytes >= block_bytes):
            return None, None
        from keyacc_ray.engine.kv_store import KVStore
        from keyacc_ray.engine import node_tier

        node = None
        if node_bytes >= block_bytes:
            s = self.runner.kv_shape
            space = node_tier.namespace(config.model, s.num_layers, s.num_kv_heads, s.head_dim, s.v_dim,
                                        dtype_name(s.dtype), config.kv_block_size, config.cpu_weight_quant)
            node = node_tier.NodeTier(config.kv_node_tier_dir or node_tier.default_root(node_bytes), space,
                                      block_bytes, node_bytes)
        tiers = LowerTiers(host, disk, block_bytes, config.kv_block_size, node=node,
                           always_load=config.kv_tier_load == "always")
        store = KVStore(self.runner.cache, tiers, config.kv_disk_tier_dir)
        self.blocks.on_evict = tiers.evicted
        self.scheduler.lower = tiers
        log.info("KV tiers under the block pool: %d host blocks, %d node blocks (%s), %d disk blocks (%s), "
                 "%d bytes each", host, node.num_slots if node else 0, node.dir if node else "-", disk,
                 store.disk_dir or "-", block_bytes)
        return tiers, store

    def _kv_events(self, config: EngineConfig) -> KVEvents | None:
        """What the router is told of the prefix blocks held here (engine/kv_events.py): where the
        prefix cache is on and its blocks are the router's (ANCHOR_BLOCK tokens)."""
        if not config.enable_prefix_caching or config.kv_block_size != ANCHOR_BLOCK:
            return None
        return kv_events.attach(self.blocks, self.tiers)

    # ---- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if any(not isinstance(t, int) or t < 0 or t >= self.runner.vocab_size for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.runner.vocab_size})", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                                 f"{self.max_model_len} tokens", param="prompt", code="context_length_exceeded")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                 f"exceeds the context of {self.max_model_len} tokens",
                                 param="max_tokens", code="context_length_exceeded")
        if not self.blocks.can_ever_allocate(len(prompt_ids) + params.max_tokens):
            need = self.blocks.blocks_for(len(prompt_ids) + params.max_tokens)
            raise InvalidRequest(f"the request needs {need} KV blocks; this replica has "
                                 f"{self.blocks.num_blocks} in all", param="max_tokens")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        if request_id in self.seqs:
            raise InvalidRequest(f"duplicate request id {request_id!r}")
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params)
        self._enqueue(seq, rng_state=None)
        return seq

    def _scoring(self, seq: Sequence) -> bool:
        """A fresh prompt whose tokens are scored as it is prefilled (prompt logprobs)."""
        return seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0

    def _enqueue(self, seq: Sequence, rng_state) -> None:
        scoring = self._scoring(seq)
        if scoring:  # every position's logits come back: chunks whose logits fit
            seq.max_chunk = max(1, PROMPT_LOGITS_BYTES // (4 * self.runner.vocab_size))
        seq.share_prefix = not scoring  # (every prompt position's logits are computed: none shared)
        self.sampler.add(seq.request_id, seq.params, rng_state)  # first: a grammar that does not compile
        if not self.scheduler.add(seq):
            self.sampler.remove(seq.request_id)
            raise Overloaded(f"the engine's waiting queue is full ({self.config.max_waiting})")
        self.seqs[seq.request_id] = seq
        seq.arrival = time.monotonic()
        self.detok[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], seq.params.stop,
            seq.output_token_ids, seq.emitted_text_chars, seq.params.include_stop_str_in_output,
            seq.params.skip_special_tokens)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None:
            self._finish(seq, SeqStatus.FINISHED_ABORTED)

    def withdraw(self, request_id: str) -> bool:
        """A sequence still waiting for its first step here (never run: nothing generated, no KV
        brought) leaves, to start over elsewhere; False (and nothing happens) once it has run."""
        seq = self.seqs.get(request_id)
        if (seq is None or seq.status != SeqStatus.WAITING or seq.num_output_tokens or seq.num_cached
                or seq.imported is not None):
            return False
        self._finish(seq, SeqStatus.FINISHED_ABORTED)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward for every scheduled sequence (decode rows and prompt chunks together),
        then one batched sampling of the rows that produce a token. With asynchronous
        scheduling, the step launched ahead by the last call is read back instead, where any of
        its rows is still running (after launching the next one, where it may)."""
        if self._ahead is not None:
            outs = self._collect()
            if outs is not None:
                return outs
        if not self.prefill_delay_factor:
            return self._scheduled(self.scheduler.schedule())
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        outs = self._scheduled(sched)
        if sched.prefill:  # a step with prompt tokens (eager): while the sequences decode, fresh
            now = time.monotonic()  # prompts wait a while for one another (scheduler.py)
            self.scheduler.hold_until = now + self.prefill_delay_factor * (now - t0)
        return outs

    def _scheduled(self, sched) -> list[RequestOutput]:
        """A scheduled step, recorded where KEYACC_STEP_TRACE_DIR asks for it (step_trace.py)."""
        return self._step(sched) if self._step_trace is None else self._step_trace.step(sched, self._step)

    def label_step_trace(self, pool: str) -> None:
        """Name the pool this engine serves in its step trace's records, where one is kept (a
        trace's reader tells the pools' engines apart by it: scripts/simulate.py's co-run fit)."""
        if self._step_trace is not None:
            self._step_trace.pool = pool

    def _step(self, sched) -> list[RequestOutput]:
        if self.tiers is not None and self.tiers.moves:  # blocks to and from the lower tiers
            self.kv_store.run(self.tiers.take_moves())
        for s in sched.preempted:
            if s.request_id in self.move_on_preempt:  # leaves with its KV (its blocks are intact this step)
                self.preempt_exports.append(self.export_request(s.request_id,
                                                                blocks=sched.preempted_tables[s.request_id],
                                                                skip_tokens=self.move_on_preempt[s.request_id]))
                continue
            s.num_cached = 0  # its KV is gone: readmitted, it prefills again
        now = time.monotonic()
        for s in sched.admitted:
            if s.arrival is not None:  # vLLM's queue time: from arrival to first scheduled
                self.histograms["vllm:request_queue_time_seconds"].observe(now - s.arrival)
                s.arrival, s.scheduled_at = None, now
            if s.imported is not None:
                self._write_imported(s)
        arrays = self._decode_arrays(sched.decode) if not sched.prefill and self.runner.decodes_arrays else None
        self._last_decode = None  # (carried only from a step of decode rows alone that completed)
        if arrays is not None:  # decode rows alone (the common step): arrays, no items
            self.histograms["vllm:iteration_tokens_total"].observe(len(sched.decode))
            if self.async_scheduling and self._plain(sched.decode):
                return self._run_launched(self._launch(sched.decode, *arrays), range(len(sched.decode)))
            logits = self.runner.decode(*arrays)
            outs = self._decoded(sched.decode, logits, arrays[1] + 1)
            self._last_decode = (arrays[1], arrays[2], self.blocks.row_changes)  # (its tokens: in self._batch)
            return outs
        table, row = self.blocks.table_ref, self.blocks.row.get
        items = [StepItem([s.token_ids[-1]], s.num_cached, table(s.request_id), "last", row(s.request_id, -1))
                 for s in sched.decode]
        for s, n in sched.prefill:
            logits = "all" if self._scoring(s) else ("last" if s.num_cached + n == s.num_tokens else "none")
            items.append(StepItem(s.token_ids[s.num_cached:s.num_cached + n], s.num_cached, table(s.request_id),
                                  logits))
        if not items:
            return []
        self.histograms["vllm:iteration_tokens_total"].observe(sum(len(it.tokens) for it in items))
        t0 = time.perf_counter()
        nd = len(sched.decode)
        if self.config.batched_prefill:
            logits = self.runner.forward(items, decode=not sched.prefill)
        else:  # decode rows together, each prompt chunk in a forward of its own
            parts = ([self.runner.forward(items[:nd])] if nd else []) + [self.runner.forward([it])
                                                                        for it in items[nd:]]
            logits = torch.cat(parts)
        if not sched.prefill:  # decode rows alone: a token each, logits in order
            return self._decoded(sched.decode, logits)
        caching, bs = self.blocks.prefix_caching, self.blocks.block_size
        rows, seqs, at = [], [], 0
        for i, (s, it) in enumerate(zip([*sched.decode, *(p[0] for p in sched.prefill)], items)):
            n = it.num_logits
            if it.logits == "all":
                self._score_chunk(s, it, logits[at:at + n])
            at += n
            s.num_cached += len(it.tokens)
            if caching and (i >= nd or s.num_cached % bs == 0):  # (a decode row: when it fills a block)
                self._cache_blocks(s)
            if s.num_cached == s.num_tokens:
                rows.append(at - 1)
                seqs.append(s)
        if not seqs:
            self._prefill_timed(sched.prefill, t0, logits)
            return []
        if len(rows) < logits.shape[0]:  # (every row's logits, in order, is the common decode step)
            logits = logits[torch.tensor(rows, device=logits.device)]
        sampled = self._sample(logits, seqs)
        self._prefill_timed(sched.prefill, t0, None)
        return self._postprocess(seqs, sampled)

    # ---- asynchronous scheduling -------------------------------------------------------
    # In a run of decode steps of plain rows (DecodeBatch.plain) over the static buffers, step
    # n+1 is launched (forward, sampling, the ids' copy to the host) before step n's ids are
    # read, its token ids taken from step n's on the device, and step n is postprocessed while
    # n+1 runs. Rows whose step-n token is their last by length are left out of n+1; a row that
    # ends at step n otherwise (end of sequence, a stop) or leaves before n+1 is read (abort,
    # export) is computed in n+1 and dropped: its extra key lies past what its sequence holds,
    # in blocks it gives back (written, on a GPU, before any later step's writes there). Draws
    # are keyed by position, so the tokens are the synchronous engine's.

    def _batch_of(self, seqs: list[Sequence]) -> DecodeBatch:
        """The DecodeBatch of these rows (the last one where they are its rows: a decode batch is
        the same rows step after step)."""
        batch = self._batch
        if batch is None or not batch.same(seqs):
            batch = self._batch = DecodeBatch(seqs)
        return batch

    def _plain(self, seqs: list[Sequence]) -> bool:
        return self._batch_of(seqs).plain

    def _launch(self, seqs: list[Sequence], ids: np.ndarray, pos: np.ndarray, rows: np.ndarray,
                prev: torch.Tensor | None = None) -> Launched:
        """Run (on a GPU: queue) a decode step of plain rows and its sampling; start the ids' copy.
        `prev`: the ids of the step before, on the device (`ids` then index them)."""
        self._last_decode = None  # (the synchronous path's carried batch: not kept here)
        batch = self._batch_of(seqs)
        logits = self.runner.decode(ids, pos, rows, prev)
        with torch.inference_mode():
            sampled = self.sampler.sample(logits, batch.rids, batch.params, positions=pos + 1, keep_logits=False,
                                          to_host=False)
        return Launched(seqs, pos, rows, sampled, HostCopy(sampled, self._copies))

    def _run_launched(self, f: Launched, alive) -> list[RequestOutput]:
        """Launch the next step where it may, then read `f`'s ids and postprocess its rows
        `alive` (indices; the others have left since it was launched)."""
        alive = list(alive)
        self._ahead = self._launch_next(f, alive)
        tokens = f.copy.wait()
        if len(alive) < len(f.seqs):
            return self._postprocess([f.seqs[i] for i in alive], ([tokens[i] for i in alive], None), decoded=True)
        return self._postprocess(f.seqs, (tokens, None), decoded=True)

    def _collect(self) -> list[RequestOutput] | None:
        """The step launched ahead: its rows still running postprocessed (None if none is)."""
        f, self._ahead = self._ahead, None
        seqs, running = self.seqs, SeqStatus.RUNNING
        alive = [i for i, (s, p) in enumerate(zip(f.seqs, f.pos))
                 if seqs.get(s.request_id) is s and s.status == running and s.num_cached == p]
        if not alive:
            return None
        return self._run_launched(f, alive)

    def _launch_next(self, f: Launched, alive: list[int]) -> Launched | None:
        """The step after `f` (its rows `alive`, as yet unread), launched now, where the
        scheduler would run the same rows next: no other sequence running, nothing waiting or no
        place to admit it (every slot taken: the peak-load case), and every row's next key finds a
        place (lazy KV grown now, as the scheduler would; where that fails, the scheduler
        preempts next step). Cached blocks the growing takes go to their lower tier first, as in a
        scheduled step. Rows whose token from `f` is their last by length are left out (their
        slots free: a waiting request is then admitted by the scheduler, not launched past; one
        freed by a stop is seen a step later)."""
        sch = self.scheduler
        if len(sch.running) != len(alive):
            return None
        limit = self.max_model_len
        keep = [i for i in alive if (n := len(f.seqs[i].token_ids) + 1) < limit
                and n - f.seqs[i].num_prompt_tokens < f.seqs[i].params.max_tokens]
        if not keep or (sch.waiting and len(keep) < sch.max_num_seqs):
            return None
        idx = np.asarray(keep, dtype=np.int64)
        pos = f.pos[idx] + 1
        seqs = [f.seqs[i] for i in keep]
        if sch.lazy:
            blocks = self.blocks
            changes, tables, bs = blocks.row_changes, blocks.tables, blocks.block_size
            for s, p in zip(seqs, pos.tolist()):
                if p >= len(tables[s.request_id]) * bs and not blocks.grow(s.request_id, p + 1):
                    return None
            if blocks.row_changes != changes:  # (a table grown past the array's width: no row)
                return None
        if self.tiers is not None and self.tiers.moves:  # (before the step writes into those blocks)
            self.kv_store.run(self.tiers.take_moves())
        self.histograms["vllm:iteration_tokens_total"].observe(len(seqs))
        self.steps_launched_ahead += 1
        return self._launch(seqs, idx, pos, f.rows[idx], prev=f.ids)

    def _decode_arrays(self, seqs: list[Sequence]) -> tuple | None:
        """Decode rows as the runner's arrays: each one's last token id, position and row of the
        block manager's array (None where one has no row there: its table is too wide). The
        same rows as the last step, which was a step of decode rows alone, in the same order, and
        no row given or taken since (a decode batch, step after step): the tokens it sampled, its
        positions + 1, its rows, with no pass over the sequences."""
        if self._last_decode is not None:  # (then self._batch is that step's batch: nothing sampled since)
            pos, rows, changes = self._last_decode
            if changes == self.blocks.row_changes and self._batch.same(seqs):
                return self._batch.sampled, pos + 1, rows
        n, row = len(seqs), self.blocks.row.get
        rows = np.fromiter((row(s.request_id, -1) for s in seqs), dtype=np.int64, count=n)
        if not n or rows.min() < 0:
            return None
        return (np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=n),
                np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=n), rows)

    def _decoded(self, seqs: list[Sequence], logits, positions=None) -> list[RequestOutput]:
        """After a step of decode rows alone: each row's KV now holds its last token; one token
        each sampled from the logits (in row order). `positions`: the new tokens' (an array),
        where the caller has them."""
        return self._postprocess(seqs, self._sample(logits, seqs, positions), decoded=True)

    def measure_prefill_rate(self, tokens: int = 256) -> float:
        """The prefill rate before the first prompt (a pool replica calls this at start): a forward
        of up to `tokens` prompt tokens (capped by the step budget and the context) through the
        block pool, which holds nothing yet, after one that warms the kernels. Without it the
        router's policies read a pool that never prefilled as one with no limit, and at start
        sent it whole requests of any length. Requests and counters are untouched; an engine that
        has taken a request measures nothing here (its blocks may hold KV): it returns its rate."""
        n = min(tokens, self.config.max_prefill_tokens, self.max_model_len)
        used = self.seqs or self.tokens_generated or self.blocks.num_cached_blocks
        if n < self.prefill_rate.min_tokens or used or self.blocks.num_free_blocks < -(-n // self.blocks.block_size):
            return self.prefill_rate.tokens_per_s
        self.runner.forward_empty_pool(n)  # (warm-up: first calls build kernels, allocator pools)
        t0 = time.perf_counter()
        logits = self.runner.forward_empty_pool(n)
        self._prefill_timed([(None, n)], t0, logits)
        return self.prefill_rate.tokens_per_s

    def _prefill_timed(self, prefill: list, t0: float, logits) -> None:
        """The prefill rate of steps with many prompt tokens: what the router's policies read (a
        prompt sent whole to this pool takes about its tokens / this rate), and the lower tiers'
        cost model."""
        tokens = sum(n for _, n in prefill)
        if tokens < self.prefill_rate.min_tokens:
            return
        if logits is not None and logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        seconds = time.perf_counter() - t0
        self.prefill_rate.observe(tokens, seconds)
        if self.tiers is not None:
            self.tiers.prefill.observe(tokens, seconds)

    def _cache_blocks(self, s: Sequence) -> None:
        """Key the sequence's blocks that are full and computed, for later prompts to share."""
        self.blocks.register(s.request_id, chain_hashes(s.block_hashes, s.token_ids, self.blocks.block_size),
                             s.num_cached // self.blocks.block_size)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay; the lower tiers emptied); the number of
        blocks it dropped from the pool."""
        if self.tiers is not None:
            self.tiers.reset()
        return self.blocks.reset_prefix_cache()

    def _score_chunk(self, s: Sequence, it: StepItem, logits) -> None:
        """Prompt logprobs of a chunk: each position's logits score the token after it."""
        if it.start == 0:
            self._prompt_scores[s.request_id] = [None]
        targets = s.token_ids[it.start + 1:it.start + 1 + len(it.tokens)]
        if targets:
            self._prompt_scores[s.request_id] += self.sampler.logprobs(
                logits[:len(targets)], targets, [s.params.prompt_logprobs] * len(targets), ranks=True)

    def _sample(self, logits, seqs: list[Sequence], positions=None) -> tuple[list[int], list | None]:
        """One token per row, and (where some request asked for them) each row's logprobs or None.
        `positions`: each new token's position (its sequence's length), where the caller has them."""
        batch = self._batch_of(seqs)
        params, want = batch.params, batch.want
        with torch.inference_mode():  # (the logits are the forward's: in place where nothing reads them after)
            ids = self.sampler.sample(logits, batch.rids, params,
                                      lambda i: (seqs[i].token_ids, seqs[i].num_prompt_tokens, self.eos_ids),
                                      positions=[len(s.token_ids) for s in seqs] if positions is None else positions,
                                      keep_logits=bool(want))
        batch.sampled = np.array(ids, dtype=np.int64)  # (the next step's token ids if the batch holds)
        if not want:
            return ids, None
        lps: list = [None] * len(seqs)
        got = self.sampler.logprobs(logits[want], [ids[i] for i in want], [params[i].logprobs for i in want])
        for i, lp in zip(want, got):
            lps[i] = lp
        return ids, lps

    def _postprocess(self, seqs: list[Sequence], sampled: tuple[list[int], list | None],
                     decoded: bool = False) -> list[RequestOutput]:
        """Every row's new token: end of sequence or a stop token id, then the text (a stream
        decoded as bytes without stop strings at once, the others detokenized for the whole
        batch in a few calls, with their stop strings), then the length limit. `decoded`: the
        rows were a step of decode rows alone, whose KV now holds their last token (counted here,
        in the pass that touches each sequence anyway)."""
        tokens, lps = sampled
        caching, bs = self.blocks.prefix_caching, self.blocks.block_size
        eos, limit, detok = self.eos_ids, self.max_model_len, self.detok
        ds = [detok[s.request_id] for s in seqs]
        texts: list = [None] * len(seqs)  # the rows' text where known in the first pass
        stopped: dict[int, SeqStatus] = {}
        det_d, det_t, det_i = [], [], []  # rows detokenized together
        for i, (seq, token, d) in enumerate(zip(seqs, tokens, ds)):
            if decoded:
                seq.num_cached += 1
                if caching and seq.num_cached % bs == 0:
                    self._cache_blocks(seq)
            seq.token_ids.append(token)
            p = seq.params
            # (a grammar's end is an end of sequence even with ignore_eos: nothing else may follow)
            if (token in eos and (not p.ignore_eos or p.grammar is not None)) or token in p.stop_token_ids:
                stopped[i] = SeqStatus.FINISHED_STOPPED
                if not p.include_stop_str_in_output:  # else the stop token's own text, as vLLM
                    continue
            if d.bytes is not None and not d.stop:  # (d.streams_bytes, inline)
                texts[i] = d.stream_step(token)
                continue
            det_d.append(d)
            det_t.append(token)
            det_i.append(i)
        self.tokens_generated += len(seqs)
        if det_d:
            for i, hit in zip(det_i, step_all(det_d, det_t)):
                if hit:
                    stopped.setdefault(i, SeqStatus.FINISHED_STOPPED)
        outs = []
        scores = self._prompt_scores
        now = time.monotonic()
        for i, (seq, token, d, lp, text) in enumerate(zip(seqs, tokens, ds, lps if lps is not None else repeat(None),
                                                          texts)):
            if seq.first_token_at is None:  # its first token here: a prompt's ends its prefill
                seq.first_token_at = now
                if seq.num_output_tokens == 1 and seq.scheduled_at is not None:
                    self.histograms["vllm:request_prefill_time_seconds"].observe(now - seq.scheduled_at)
            n = len(seq.token_ids)
            n_out = n - seq.num_prompt_tokens
            st = stopped.get(i) if stopped else None
            if st is None and (n_out >= seq.params.max_tokens or n >= limit):
                st = SeqStatus.FINISHED_LENGTH
            if st is None:
                outs.append(RequestOutput(seq.request_id, [token], d.take(False) if text is None else text, False,
                                          None, seq.num_prompt_tokens, n_out, None if lp is None else [lp],
                                          scores.pop(seq.request_id, None) if scores else None,
                                          seq.num_cached_prompt_tokens))
                continue
            outs.append(RequestOutput(seq.request_id, [token], d.take(True) if text is None else text + d.take(True),
                                      True, st.finish_reason, seq.num_prompt_tokens, n_out,
                                      None if lp is None else [lp], scores.pop(seq.request_id, None) if scores else None,
                                      seq.num_cached_prompt_tokens))
            self._finish(seq, st)
        return outs

    def _finish(self, seq: Sequence, status: SeqStatus) -> None:
        if status != SeqStatus.FINISHED_ABORTED and seq.scheduled_at is not None:  # its part here
            now = time.monotonic()
            self.histograms["vllm:request_inference_time_seconds"].observe(now - seq.scheduled_at)
            if seq.first_token_at is not None:
                self.histograms["vllm:request_decode_time_seconds"].observe(now - seq.first_token_at)
        self.move_on_preempt.pop(seq.request_id, None)
        if status != SeqStatus.FINISHED_EXPORTED:  # (an export published its blocks itself)
            self._publish(seq, self.blocks.tables.get(seq.request_id, []))
        self.scheduler.finish(seq, status)
        self.seqs.pop(seq.request_id, None)
        if not self.seqs and self.tiers is not None and self.tiers.moves:  # (no next step to run them)
            self.kv_store.run(self.tiers.take_moves())
        self.sampler.remove(seq.request_id)
        self.detok.pop(seq.request_id, None)
        self._prompt_scores.pop(seq.request_id, None)

    def _publish(self, seq: Sequence, table: list[int]) -> None:
        """Plan copies of the sequence's full computed blocks into the node's tier, where there is
        one: other engines on the node (another pool, a later hand-off) load them from there."""
        if self.tiers is None or self.tiers.node is None or seq.imported is not None:
            return
        bs = self.blocks.block_size
        n = min(seq.num_cached // bs, len(table))
        if n > 0:
            self.tiers.publish(chain_hashes(seq.block_hashes, seq.token_ids, bs)[:n], table[:n])

    # ---- hand-off ----------------------------------------------------------------------
    def export_request(self, request_id: str, layout: str | None = None, source: str = "",
                       blocks: list[int] | None = None, skip_tokens: int = 0) -> KVPackage:
        """Remove a sequence from this engine and return its full state as a KVPackage (`blocks`:
        the table of a sequence preempted this step, whose KV its freed blocks still hold).
        `skip_tokens`: the importer is expected to hold the sequence's head up to there in its
        prefix cache or in the node's tier: the K/V of the whole blocks within it are left out
        (KVMeta.kv_start). Its full blocks go into the node's tier, where there is one."""
        seq = self.seqs[request_id]
        layout = layout or self.config.kv_export_layout
        blocks = blocks if blocks is not None else self.blocks.block_table(request_id)
        if seq.imported is None:
            n = seq.num_cached if blocks else 0
            bs = self.blocks.block_size
            skip = max(0, min(skip_tokens, n)) // bs * bs
            self._publish(seq, blocks)
            if self.tiers is not None and self.tiers.moves:
                self.kv_store.run(self.tiers.take_moves())
                if skip and self.tiers.node is not None:
                    self.tiers.node.flush()  # (written before the importer looks for what was left out)
            k, v = self.runner.read_kv(blocks[skip // bs:], n - skip)
            meta = self.kv_meta(layout, n, source or str(self.runner.device), kv_start=skip)
            self.kv_export_skipped_tokens += skip
            keys, values = to_wire(k, layout), to_wire(v, layout)
        else:  # still waiting with an imported package: pass its arrays on untouched
            meta, keys, values = seq.imported.meta, seq.imported.keys, seq.imported.values
        pkg = KVPackage(meta, keys, values, request_id, list(seq.token_ids), seq.num_prompt_tokens,
                        seq.params.to_dict(), self.sampler.state(request_id), self.detok[request_id].emitted)
        self._finish(seq, SeqStatus.FINISHED_EXPORTED)
        return pkg

    def kv_meta(self, layout: str, num_kv_tokens: int, source: str, kv_start: int = 0) -> KVMeta:
        """What a package of this engine's KV says about itself."""
        s = self.runner.kv_shape
        return KVMeta(self.config.model, s.num_layers, s.num_kv_heads, s.head_dim, dtype_name(s.dtype), layout,
                      num_kv_tokens, self.config.kv_block_size, source, s.v_head_dim, kv_start)

    def _kv_dims(self) -> tuple[int, int, int, int]:
        s = self.runner.kv_shape
        return (s.num_layers, s.num_kv_heads, s.head_dim, s.v_dim)

    def import_request(self, pkg: KVPackage, request_id: str | None = None,
                       params: SamplingParams | None = None) -> Sequence:
        """Queue a sequence exported by another engine; it continues exactly where it stopped.
        `params` may replace the sampling parameters (e.g. a smaller max_tokens for one period)."""
        rid = request_id or pkg.request_id
        if rid in self.seqs:
            raise InvalidRequest(f"duplicate request id {rid!r}")
        dims = self._kv_dims()
        got = pkg.meta.dims
        if got != dims:
            raise InvalidRequest(f"KV package for {got} (layers, kv_heads, k_dim, v_dim) cannot continue "
                                 f"on this engine's model {dims}")
        if pkg.meta.num_kv_tokens > 0:
            try:
                check_span(pkg)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        params = params or SamplingParams(**pkg.params)
        seq = Sequence(rid, list(pkg.token_ids), pkg.num_prompt_tokens, params,
                       emitted_text_chars=pkg.emitted_text_chars)
        seq.imported = pkg if pkg.meta.num_kv_tokens > 0 else None
        seq.num_cached = pkg.meta.num_kv_tokens  # in the package until admission writes it into blocks
        if seq.num_output_tokens >= params.max_tokens:
            raise InvalidRequest("the imported sequence has no tokens left to generate", param="max_tokens")
        self.validate(seq.token_ids[:seq.num_prompt_tokens], params)
        self._enqueue(seq, rng_state=pkg.rng_state)
        return seq

    def _write_imported(self, seq: Sequence) -> None:
        """Its package's K/V into its blocks, past the head its admission found cached here
        (`seq.kv_from` tokens, shared: those bytes are not copied)."""
        pkg, start = seq.imported, seq.kv_from
        with warnings.catch_warnings():  # object-store views are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            k, v = to_engine_tensors(pkg, self.runner.dtype, self.runner.device, self._kv_dims(), start=start)
        self.runner.write_kv(self.blocks.table_ref(seq.request_id)[start // self.blocks.block_size:], k, v)
        seq.imported, seq.kv_from = None, 0
        if self.blocks.prefix_caching:
            self._cache_blocks(seq)

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting,
                           self.blocks.num_free_blocks, self.blocks.num_blocks, self.blocks.block_size,
                           self.config.max_num_seqs, self.tokens_generated, self.runner.device_label(),
                           self.scheduler.num_preemptions, self.blocks.queries, self.blocks.hits,
                           self.blocks.num_cached_blocks, self.blocks.evictions, self._tier_stats(),
                           {name: h.to_dict() for name, h in self.histograms.items()}, self.prefill_rate.tokens_per_s,
                           self.steps_launched_ahead, self.kv_export_skipped_tokens,
                           self.scheduler.import_cached_tokens, self.scheduler.import_recomputed_tokens,
                           self.scheduler.max_waiting)

    def _tier_stats(self) -> dict | None:
        t = self.tiers
        if t is None:
            return None
        return {"tiers": {x.name: {"hits": t.hits[x.name], "loaded_blocks": t.loaded[x.name],
                                   "stored_blocks": t.stored[x.name], "blocks": len(x), "slots": x.num_slots,
                                   "evictions": x.evictions, "bandwidth": _two_digits(t.bandwidth[x.name]),
                                   "reprobes": t.reprobes[x.name]}
                          for x in t.all_tiers()},
                "recomputed_blocks": t.recomputed, "block_bytes": t.block_bytes,
                "node_dir": t.node.dir if t.node is not None else None}

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 timeout_s: float = 600.0) -> list[list[int]]:
        """Convenience: run prompts to completion; returns each request's output token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        outs: dict[str, list[int]] = {i: [] for i in ids}
        for i, p, sp in zip(ids, prompts, plist):
            self.add_request(i, p, sp)
        deadline = time.monotonic() + timeout_s
        while any(i in self.seqs for i in ids):
            assert time.monotonic() < deadline, "generate() timed out"
            for o in self.step():
                if o.request_id in outs:
                    outs[o.request_id].extend(o.new_token_ids)
        return [outs[i] for i in ids]
