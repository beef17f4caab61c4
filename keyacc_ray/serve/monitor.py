"""The load monitor: a live picture of every pool for the router and for /metrics.

`LoadState` is plain Python: replicas push reports (queue depth, running sequences, free KV
blocks, tokens/s); `snapshot()` aggregates them per pool, drops stale replicas, and adds GPU
(pynvml) and per-NUMA-node CPU (psutil) figures. `LoadMonitor` is the thin Ray actor shell.

Every change of content (a report that differs from the replica's last one, counters, a replica
gone stale, new system figures) bumps `version`; `snapshot(since=v)` answers None while nothing
changed since version v, so an idle server's routers poll without moving a snapshot each time.
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields

from keyacc_ray.histogram import sum_stats

MONITOR_NAME = "keyacc_load_monitor"  # the detached actor's name (pools report to it, the router reads it)
MONITOR_NAMESPACE = "keyacc"
STALE_AFTER_S = 5.0
INGRESS_KEEP_S = 60.0
RETIRED = "retired"  # the ingress entry holding the figures of replicas that are gone
SYSTEM_EVERY_S = 1.0
KV_LOG_EVENTS = 200_000  # the engines' KV events kept for the routers to read (LoadState.kv_log)


@dataclass
class ReplicaReport:
    deployment: str  # e.g. "GpuDecode"
    pool: str  # "gpu" or "cpu"
    role: str  # "prefill", "decode" or "whole"
    replica: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    max_num_seqs: int
    tokens_per_s: float
    tokens_generated: int
    emulated: bool  # a "GPU" replica running on CPU cores with an emulated KV budget
    device: str
    time_s: float = 0.0
    num_preemptions: int = 0  # lazy KV: sequences preempted (recomputed later), since start
    # prefix cache since start: prompt tokens looked up and found (vLLM's names), blocks evicted;
    # blocks holding a cached prefix now
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    num_cached_blocks: int = 0
    kv_tiers: dict | None = None  # the lower tiers' figures (LLMEngine's EngineStats.kv_tiers)
    histograms: dict | None = None  # vLLM's per-engine histograms (LLMEngine's EngineStats.histograms)
    prefill_tokens_per_s: float = 0.0  # LLMEngine's EngineStats.prefill_tokens_per_s (0: not measured)
    steps_launched_ahead: int = 0  # LLMEngine's EngineStats.steps_launched_ahead (asynchronous scheduling)
    # hand-offs and the prefix cache (LLMEngine's EngineStats of the same names)
    kv_export_skipped_tokens: int = 0
    kv_import_cached_tokens: int = 0
    kv_import_recomputed_tokens: int = 0
    max_waiting: int = 0  # its engine's waiting-queue bound (EngineStats.max_waiting; 0: not told)
    # the node's shared KV tier its engine reads and writes: "<Ray node id>:<directory>" ("": none);
    # replicas with the same one share each other's blocks
    node_tier: str = ""
    # where its engine holds the prefix blocks the router keys prompts by, changed since its last
    # report (engine/kv_events.py): (key, tier) each; the monitor moves them into its log
    kv_events: list | None = None

    def content(self) -> tuple:
        """Everything but the arrival time: equal content means nothing to tell anyone."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "time_s")

    def as_dict(self) -> dict:
        """Its fields, shallow (what the snapshot carries; asdict's deep copy of the histograms
        was most of a snapshot's cost)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class DeploymentView:
    deployment: str
    pool: str
    replicas: int = 0
    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 0
    max_waiting: int = 0  # its replicas' waiting-queue bounds, summed (0: not told)
    max_free_blocks: int = 0  # the most free blocks on one replica: what one request can get
    tokens_per_s: float = 0.0
    emulated: bool = False
    prefill_tokens_per_s: float = 0.0  # one replica's, the mean of those that measured it (0: none)

    @property
    def free_slots(self) -> int:
        return self.max_num_seqs - self.num_running - self.num_waiting


@dataclass
class Snapshot:
    time_s: float
    deployments: dict[str, DeploymentView] = field(default_factory=dict)
    replicas: list[dict] = field(default_factory=list)
    gpu: dict = field(default_factory=dict)
    cpu_numa: list[dict] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    version: int = 0
    ingress: dict = field(default_factory=dict)  # ingress replica -> (time, its request figures: metrics.RequestStats)
    # the engines' KV events after the asker's place in the log: (deployment, replica, key, tier)
    # each; `kv_log`: (the log's id, the place after them); `kv_complete`: False when the log had
    # moved on past the asker's place (or it had none, or another log's): events were missed
    kv_events: list = field(default_factory=list)
    kv_log: tuple = (0, 0)
    kv_complete: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def mean_measured(rates: list[float]) -> float:
    """The mean of the rates that were measured (> 0): a prompt goes through one replica, so a
    pool's prefill rate is a replica's; 0 when none was."""
    known = [x for x in rates if x > 0]
    return sum(known) / len(known) if known else 0.0


class LoadState:
    def __init__(self, clock=time.monotonic, system_probe=None):
        self.clock = clock
        self.reports: dict[str, ReplicaReport] = {}
        self.counters: dict[str, float] = {}
        self.ingress: dict[str, tuple[float, dict]] = {}
        self._system_probe = system_probe
        self._system: tuple[float, dict, list] = (-1e9, {}, [])
        # a random start: a router holding a version from a monitor that restarted never mistakes
        # it for this one's
        self.version = random.getrandbits(48)
        # the engines' KV events, numbered: a router reads those after its place (snapshot's
        # kv_after); a log of its own id, so that a router never reads a restarted monitor's
        # places as its own
        self.kv_log: deque = deque(maxlen=KV_LOG_EVENTS)
        self.kv_log_id = random.getrandbits(48)
        self.kv_seq = 0

    def report(self, r: ReplicaReport) -> None:
        r.time_s = self.clock()
        events, r.kv_events = r.kv_events, None
        if events:
            for key, tier in events:
                self.kv_seq += 1
                self.kv_log.append((self.kv_seq, r.deployment, r.replica, key, tier))
            self.version += 1
        old = self.reports.get(r.replica)
        if old is None or old.content() != r.content():
            self.version += 1
        self.reports[r.replica] = r

    def kv_events_after(self, after: tuple | None) -> tuple[list, tuple, bool]:
        """The KV events after the place `after` ((log id, seq) from a snapshot; None: none yet):
        (events, the new place, whether none were missed)."""
        log, place = self.kv_log, (self.kv_log_id, self.kv_seq)
        if after is None or after[0] != self.kv_log_id:
            return [e[1:] for e in log], place, not log or log[0][0] == 1
        seq = after[1]
        if seq >= self.kv_seq:
            return [], place, True
        newer = []  # walked from the newest end: the cost is the events returned, not the log's length
        for e in reversed(log):
            if e[0] <= seq:
                break
            newer.append(e[1:])
        newer.reverse()
        first = log[0][0] if log else self.kv_seq + 1
        return newer, place, seq + 1 >= first

    def report_ingress(self, replica: str, stats: dict) -> None:
        """An ingress replica's cumulative request figures (a replica not heard of for
        INGRESS_KEEP_S is gone: its figures are folded into the RETIRED entry, so the sums the
        ingress replicas show never go back)."""
        self.ingress[replica] = (self.clock(), stats)
        self.version += 1

    def add_counters(self, deltas: dict[str, float]) -> None:
        for k, v in deltas.items():
            self.counters[k] = self.counters.get(k, 0) + v
        if deltas:
            self.version += 1

    def _system_view(self) -> tuple[dict, list]:
        now = self.clock()
        if self._system_probe and now - self._system[0] > SYSTEM_EVERY_S:
            gpu, cpu = self._system_probe()
            if (gpu, cpu) != self._system[1:]:
                self.version += 1
            self._system = (now, gpu, cpu)
        return self._system[1], self._system[2]

    def snapshot(self, since: int | None = None, kv_after: tuple | None = None) -> Snapshot | None:
        """The aggregate view; None if `since` is given and nothing changed after that version.
        With the KV events after `kv_after` (kv_events_after)."""
        now = self.clock()
        stale = [k for k, r in self.reports.items() if now - r.time_s > STALE_AFTER_S]
        for rid in stale:
            del self.reports[rid]
        gone = [k for k, (t, _) in self.ingress.items() if now - t > INGRESS_KEEP_S and k != RETIRED]
        if gone:  # a replica that is gone: its figures stay in the sum (counters never go back)
            kept = [self.ingress.pop(k)[1] for k in gone] + ([self.ingress[RETIRED][1]] if RETIRED in self.ingress else [])
            self.ingress[RETIRED] = (now, sum_stats(kept))
        self.version += bool(stale or gone)
        gpu, cpu = self._system_view()
        if since is not None and since == self.version:
            return None
        views: dict[str, DeploymentView] = {}
        prefill_rates: dict[str, list[float]] = {}
        for r in self.reports.values():
            v = views.setdefault(r.deployment, DeploymentView(r.deployment, r.pool, block_size=r.block_size,
                                                              emulated=r.emulated))
            v.replicas += 1
            v.num_waiting += r.num_waiting
            v.num_running += r.num_running
            v.num_free_blocks += r.num_free_blocks
            v.num_total_blocks += r.num_total_blocks
            v.max_num_seqs += r.max_num_seqs
            v.max_waiting += r.max_waiting
            v.max_free_blocks = max(v.max_free_blocks, r.num_free_blocks)
            v.tokens_per_s += r.tokens_per_s
            prefill_rates.setdefault(r.deployment, []).append(r.prefill_tokens_per_s)
        for d, rates in prefill_rates.items():
            views[d].prefill_tokens_per_s = round(mean_measured(rates), 1)
        events, place, complete = self.kv_events_after(kv_after)
        return Snapshot(now, views, [r.as_dict() for r in self.reports.values()], gpu, cpu, dict(self.counters),
                        self.version, dict(self.ingress), events, place, complete)


def _system_probe():
    from keyacc_ray.hw.topology import cpu_load_per_numa, gpu_info

    return gpu_info(), cpu_load_per_numa()


class LoadMonitor:
    """Ray actor shell over LoadState (wrapped with ray.remote by the router)."""

    def __init__(self):
        self.state = LoadState(system_probe=_system_probe)

    def report(self, r: ReplicaReport) -> None:
        self.state.report(r)

    def add_counters(self, deltas: dict) -> None:
        self.state.add_counters(deltas)

    def report_ingress(self, replica: str, stats: dict) -> None:
        self.state.report_ingress(replica, stats)

    def snapshot(self, since: int | None = None, kv_after: tuple | None = None) -> Snapshot | None:
        return self.state.snapshot(since, kv_after)

    def ping(self) -> str:
        return "ok"
