"""The simulated server: the real Router (keyacc_ray/serve/router.py, with its policy) deciding
every hop on simulated time, fed by the real LoadState (the load monitor's plain core) from the
simulated engines' reports, over SimEngines whose steps take modelled time.

What the serving graph does is walked as its pieces do it: the ingress's driver asks the router
(`begin`, `advance`, `finish`), a pool checks with the router after each CPU period and after a
colocated prefill (in place when the answer names the same hop), a sequence the GPU engine
preempts leaves with its KV where the router marked it movable, a full engine queue answers with
backpressure, CPU pools offer unstarted requests for recall, replicas report every
REPORT_EVERY_S and the router refreshes its snapshot every REFRESH_EVERY_S. A hand-off costs its
KV bytes over a bandwidth plus a fixed time. The GPU pool is colocated (one engine for both
phases, the default graph). No Ray, no torch.
"""
from __future__ import annotations

import asyncio
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from keyacc_ray.engine.request import SeqStatus
from keyacc_ray.serve.driver import REFUSED_RETRY_S
from keyacc_ray.serve.messages import HopEnd, Ticket
from keyacc_ray.serve.monitor import LoadState
from keyacc_ray.serve.router import REFRESH_EVERY_S, Router
from keyacc_ray.sim.engine import SimEngine
from keyacc_ray.sim.steptime import StepTime
from keyacc_ray.sim.workload import SimRequest

REPORT_EVERY_S = 0.2  # as keyacc_ray/serve/pools.py
RECALL_AFTER_S = 0.5
RECALL_EVERY_S = 0.5
MOVE_WINDOW_S = 2.0  # the window PoolSpec.own_s_per_move reads moves over


@dataclass
class PoolSpec:
    steptime: StepTime
    replicas: int = 1
    max_num_seqs: int = 64
    num_blocks: int = 1024
    block_size: int = 16
    max_prefill_tokens: int = 4096
    lazy: bool = True
    growth_reserve: bool = False  # lazy admission with room to grow (EngineConfig.kv_growth_reserve)
    max_waiting: int = 1024
    # the replica's own CPU per token beyond the engine's step, on the engine's core (the older
    # model: scripts/bench_pool_host.py measured 0.18-0.21 ms a token on the AMD VM; on the Xeon VM
    # the replica's other threads take a share of its core whatever the rate instead: own_cores)
    pool_s_per_token: float = 0.0
    # the replica's own threads beyond the engine's (report loop, streaming, Serve's side: pinned with
    # the engine) take this share of its core while it works (scripts/bench.py's engine_thread_cores
    # against cores_used: 0.05 on this box, whatever the token rate)
    own_cores: float = 0.0
    # and this much more CPU on that core for each request moved between the pools (either way: its
    # KV's export or import on the replica's Serve side, the object store, the KV directory), at
    # the rate of the last MOVE_WINDOW_S (scripts/simulate.py's fit_stack: ~3 ms a move here)
    own_s_per_move: float = 0.0
    # a step takes this many times the profile's time while the other pool's engine works too (the
    # two engines and the stack then share the box: caches, the memory bus, the stack's processes
    # taking slices of the engine's core); the profile is measured with nothing beside it.
    # scripts/simulate.py --validate fits it from the real run's step trace (keyacc_ray/sim/corun.py;
    # on this box 1.05-1.06 for the emulated GPU pool, 0.97-1.04 for the CPU pool)
    corun_factor: float = 1.0
    under_way: int = 0  # EngineConfig.max_num_seqs_under_way (0: off, its default)


@dataclass
class ServerSpec:
    gpu: PoolSpec
    cpu: PoolSpec
    kv_bytes_per_token: int = 0  # a hand-off moves (prompt + generated) x this
    handoff_bw_bytes_s: float = 10e9  # device -> host -> object store -> host (-> device)
    handoff_fixed_s: float = 0.005  # the hops' calls, export and import
    max_model_len: int = 1 << 20
    # the serving stack (HTTP, ingress, router, monitor, the pools' Serve side, a load generator on
    # the same box): it needs stack_fixed_cores + stack_s_per_token x the tokens/s of the last second
    # of CPU, on `stack_cores` cores that the engines (a core each) run on too. It takes the cores
    # no engine is working on first; only what it needs beyond them comes out of the busy engines,
    # shared evenly: each step of a busy engine then takes 1 / (1 - that share - its replica's own
    # threads' share, PoolSpec.own_cores) of its time. (On this 2-core box a pool alone left the
    # stack a core: it lost nothing; both pools working lost 0.2-0.25 of a core each,
    # scripts/bench.py's cores_used.) 0: a stack on cores of its own.
    stack_s_per_token: float = 0.0
    stack_cores: float = 1.0
    stack_fixed_cores: float = 0.0
    # the stack's own latency on a request's way with no queue anywhere (HTTP, ingress, router, the
    # pool's Serve side, the stream's batching): half before the router sees a new request, half on
    # each token's way back to its client (whose next request starts when its last token is in)
    request_path_s: float = 0.0
    # a request's first hop waits this much longer for its replica to take it when that replica's
    # engine is working (the replica's event loop shares its core, and the GIL, with the engine
    # thread): the real trace's hop_start_p50_ms here, 5-7 ms at 2 clients, 10-17 at 8-40
    hop_start_busy_s: float = 0.0
    # the spread of a step's time about the model's (its coefficient of variation; 0: every step
    # exactly as modelled): a real engine's steps vary, and clients sending in lockstep (a closed
    # loop of equal requests) drift apart by it. Drawn from a seeded source (`seed`).
    step_jitter: float = 0.0
    seed: int = 0


@dataclass
class Live:
    req: SimRequest
    ticket: Ticket
    generated: int = 0
    first_t: float | None = None
    done_t: float | None = None
    hop_t: float = 0.0  # when its current hop began
    produced: int = 0  # tokens on the current hop since its last check
    export_after: int | None = None
    segments: list = field(default_factory=list)  # [pool, tokens]
    moves: int = 0
    error: str | None = None
    token_times: list = field(default_factory=list)  # seconds after arrival of each token
    # as the server's trace times them (at the ingress, half the request path after arrival): when
    # the first hop's engine took it, when it made the first token
    first_hop_t: float | None = None
    first_made_t: float | None = None


async def _ready():
    return None


class SimServer:
    def __init__(self, spec: ServerSpec, policy: str, policy_options: dict | None = None):
        self.spec = spec
        self._half_path = spec.request_path_s / 2
        self.now = 0.0
        self._q: list = []
        self._n = 0
        clock = self.clock
        self.state = LoadState(clock=clock)
        cpu_names = [f"CpuDecode{i}" if spec.cpu.replicas > 1 else "CpuDecode" for i in range(max(1, spec.cpu.replicas))]
        self.router = Router(cpu_names, policy, policy_options or {}, monitor=object(), colocated_gpu=True,
                             clock=clock)
        self.router._ready = _ready  # no refresher task: snapshots come from this loop (below)
        g = spec.gpu
        # every engine by name; a hop's replicas (the GPU deployment's, behind one hop as Serve
        # balances them; a CPU hop is one deployment of one replica, the router picks among them)
        self.hops: dict[str, SimEngine] = {}
        self._replicas: dict[str, list[SimEngine]] = {}
        for i in range(max(1, g.replicas)):
            e = SimEngine(f"gpu{i}", "GpuDecode", "gpu", g.steptime, g.max_num_seqs, g.num_blocks, g.block_size,
                          g.max_prefill_tokens, g.lazy, g.max_waiting, spec.max_model_len, g.pool_s_per_token,
                          g.growth_reserve, g.under_way, g.own_cores)
            self.hops["gpu_decode" if i == 0 else f"gpu_decode#{i}"] = e
            self._replicas.setdefault("gpu_decode", []).append(e)
        c = spec.cpu
        for i, name in enumerate(cpu_names if c.replicas > 0 else []):
            e = self.hops[f"cpu_decode/{i}"] = SimEngine(f"cpu{i}", name, "cpu", c.steptime, c.max_num_seqs,
                                                         c.num_blocks, c.block_size, c.max_prefill_tokens, c.lazy,
                                                         c.max_waiting, spec.max_model_len, c.pool_s_per_token,
                                                         c.growth_reserve, c.under_way, c.own_cores)
            self._replicas[f"cpu_decode/{i}"] = [e]
        self.live: dict[str, Live] = {}
        self.done: list[Live] = []
        self._suspended = 0
        self._next_of_client: dict[int, list[SimRequest]] = {}
        self._closed = None  # a time-bound closed loop: (workload's request maker, clients stop at)
        self._expected = 0
        self._recent_tokens: list[tuple[float, int]] = []  # (time, tokens) of the last second, every engine
        self._recent_moves: deque[float] = deque()  # when requests moved between the pools, the last MOVE_WINDOW_S
        self._rng = random.Random(spec.seed)
        self._sigma = math.sqrt(math.log1p(spec.step_jitter ** 2))  # a lognormal of mean 1 and that spread

    def clock(self) -> float:
        return self.now

    # ---- events ------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._q, (t, self._n, fn, args))
        self._n += 1

    def run(self, requests: list[SimRequest], until_s: float | None = None) -> list[Live]:
        """Simulate until every request is done (or `until_s`); the requests that finished."""
        return asyncio.run(self._run(requests, until_s))

    def run_closed(self, clients: int, send_for_s: float, make, stagger_s: float = 0.0) -> list[Live]:
        """The bench's closed loop: `clients` clients each send a request (`make(i)`: the i-th
        SimRequest), and the next one as soon as it ends, until `send_for_s`; then the last ones
        finish. The clients start together (the bench's), or one after another over `stagger_s`
        (load that builds up, as a service's does)."""
        self._closed = (make, send_for_s, [0])
        first = []
        for c in range(clients):
            r = make(self._closed[2][0])
            self._closed[2][0] += 1
            r.client = c
            r.arrival = stagger_s * c / clients
            first.append(r)
        return asyncio.run(self._run(first, None))

    async def _run(self, requests: list[SimRequest], until_s: float | None) -> list[Live]:
        for r in requests:
            if r.client is None:
                self.at(r.arrival, self._arrive, r)
            else:
                self._next_of_client.setdefault(r.client, []).append(r)
        for c, reqs in self._next_of_client.items():
            self.at(reqs[0].arrival, self._arrive, reqs.pop(0))
        self.at(0.0, self._report)
        self.at(0.0, self._refresh)
        self.at(RECALL_EVERY_S, self._recall)
        self._expected = len(requests)
        while self._q and len(self.done) < self._expected:
            t, _, fn, args = heapq.heappop(self._q)
            if until_s is not None and t > until_s:
                break
            self.now = t
            fn(*args)
            while self._suspended:  # a router call waits on a held request's admission: let it resume
                before = self._suspended
                await asyncio.sleep(0)
                if self._suspended == before:
                    break
        return self.done

    # ---- the router's calls, as the driver and the pools make them ---------------------------
    def _call(self, coro, then, *args) -> None:
        try:
            fut = coro.send(None)
        except StopIteration as e:
            then(e.value, *args)
            return
        self._suspended += 1  # held at the router: resumes when its place is found

        def resume(_):
            self._suspended -= 1
            self._call(coro, then, *args)

        fut.add_done_callback(resume)

    def _arrive(self, r: SimRequest) -> None:
        r.arrival = self.now
        live = Live(r, Ticket(r.rid, r.prompt_tokens, r.max_tokens, r.route))
        self.live[r.rid] = live
        if self._half_path:
            self.at(self.now + self._half_path, self._begin, live)
        else:
            self._begin(live)

    def _begin(self, live: Live) -> None:
        self._call(self.router.begin(live.ticket), self._enter, live)

    def _enter(self, t: Ticket, live: Live, waited: bool = False) -> None:
        if t.error is not None or t.hop is None:
            live.error = t.error.body["error"]["message"] if t.error is not None else "no hop"
            self._end(live)
            return
        e = self._pick(t.hop)
        if (not waited and not live.segments and self.spec.hop_start_busy_s
                and (e.busy or e.scheduler.num_running)):  # its replica takes it later (ServerSpec)
            self.at(self.now + self.spec.hop_start_busy_s, self._enter, t, live, True)
            return
        with_kv = live.generated > 0
        if not e.add(live.req.rid, live.req.prompt_tokens, live.generated, live.req.max_tokens, with_kv,
                     movable=t.move_on_preempt):
            end = HopEnd("backpressure", 0.0, live.generated, has_handoff=with_kv)
            self._call(self.router.advance(t, end), self._refused, live, t.hop.split("/")[0])
            return
        if live.segments and live.segments[-1][0] != e.pool:
            live.moves += 1
            self._recent_moves.append(self.now)
            self._forget_moves()
        live.ticket, live.hop_t, live.produced, live.export_after = t, self.now, 0, t.export_after
        if live.first_hop_t is None:
            live.first_hop_t = self.now
        live.segments.append([e.pool, 0])
        self._kick(e)

    def _refused(self, t: Ticket, live: Live, kind: str) -> None:
        """The router's answer to a refusal: the same pool again after REFUSED_RETRY_S (as the
        ingress's driver waits), any other hop at once."""
        if t.error is None and t.hop is not None and t.hop.split("/")[0] == kind:
            self.at(self.now + REFUSED_RETRY_S, self._enter, t, live)
        else:
            self._enter(t, live)

    def _pick(self, hop: str) -> SimEngine:
        """The replica a hop's request goes to: the one with the fewest sequences (Serve's
        balancing by queue length, without its sampling of two)."""
        reps = self._replicas[hop]
        if len(reps) == 1:
            return reps[0]
        return min(reps, key=lambda e: e.scheduler.num_running + e.scheduler.num_waiting)

    def _end(self, live: Live) -> None:
        live.done_t = at_client = self.now + self._half_path
        self.live.pop(live.req.rid, None)
        self.done.append(live)
        nxt = self._next_of_client.get(live.req.client) if live.req.client is not None else None
        if nxt:
            self.at(at_client, self._arrive, nxt.pop(0))
        elif self._closed is not None and live.req.client is not None and at_client < self._closed[1]:
            make, _, count = self._closed
            r = make(count[0])
            count[0] += 1
            r.client = live.req.client
            self._expected += 1
            self.at(at_client, self._arrive, r)

    # ---- engines -------------------------------------------------------------------------
    def _kick(self, e: SimEngine) -> None:
        if e.busy:
            return
        e.stack_share = self._stack_share(e)
        pool = self.spec.gpu if e.pool == "gpu" else self.spec.cpu
        e.corun = pool.corun_factor if pool.corun_factor != 1.0 and self._other_pool_works(e) else 1.0
        if pool.own_s_per_move:
            self._forget_moves()
            e.move_cores = pool.own_s_per_move * len(self._recent_moves) / MOVE_WINDOW_S
        r = e.step()
        if r is None:
            return
        for s in r.preempted_out:  # preempted on the GPU, marked movable: decode elsewhere, with its KV
            self._move(self.live[s.request_id], "handoff")
        if r.seconds > 0:
            e.busy = True
            if self._sigma:
                r.seconds *= self._rng.lognormvariate(-self._sigma ** 2 / 2, self._sigma)
            self.at(self.now + r.seconds, self._step_done, e, r)

    def _other_pool_works(self, e: SimEngine) -> bool:
        return any(o.pool != e.pool and (o.busy or o.scheduler.num_running or o.scheduler.num_waiting)
                   for o in self.hops.values())

    def _forget_moves(self) -> None:
        """Moves older than MOVE_WINDOW_S leave the window (at each move too: a spec without a
        per-move cost never reads the window, and it must not grow over a simulated hour)."""
        while self._recent_moves and self.now - self._recent_moves[0] > MOVE_WINDOW_S:
            self._recent_moves.popleft()

    def _stack_share(self, stepping: SimEngine) -> float:
        """The share of a busy engine's core the serving stack takes now: what it needs (its
        fixed part and its CPU per token x the tokens of the last second) beyond the cores no
        engine is working on, over the busy engines (`stepping` among them)."""
        sp = self.spec
        if not sp.stack_s_per_token and not sp.stack_fixed_cores:
            return 0.0
        self._recent_tokens = [(t, n) for t, n in self._recent_tokens if self.now - t <= 1.0]
        need = sp.stack_fixed_cores + sp.stack_s_per_token * sum(n for _, n in self._recent_tokens)
        busy = sum(1 for e in self.hops.values()
                   if e is stepping or e.busy or e.scheduler.num_running or e.scheduler.num_waiting)
        excess = need - max(0.0, sp.stack_cores - busy)
        return min(0.9, max(0.0, excess) / max(1, busy))

    def _step_done(self, e: SimEngine, r) -> None:
        e.busy = False
        e.busy_s += r.seconds
        e.recent.append((self.now, len(r.produced)))
        if self.spec.stack_s_per_token or self.spec.stack_fixed_cores:
            self._recent_tokens.append((self.now, len(r.produced)))
        for s in r.produced:
            live = self.live.get(s.request_id)
            if live is None or s.request_id not in e.seqs:
                continue
            live.generated += 1
            live.produced += 1
            live.segments[-1][1] += 1
            live.token_times.append(self.now + self._half_path - live.req.arrival)
            if live.first_t is None:
                live.first_t, live.first_made_t = self.now + self._half_path, self.now
            if live.generated >= live.req.output_tokens:
                e.remove(s.request_id, SeqStatus.FINISHED_STOPPED)
                end = HopEnd("done", self.now - live.hop_t, live.generated, finished=True)
                self._call(self.router.finish(live.ticket, end), lambda _, lv: self._end(lv), live)
            elif live.export_after and live.produced >= live.export_after:
                self._check(e, live)
        self._kick(e)

    def _check(self, e: SimEngine, live: Live) -> None:
        """The pool's check with the router after a period (or a colocated prefill): the same
        hop goes on in place; another one takes the sequence, its KV moved."""
        end = HopEnd("handoff", self.now - live.hop_t, live.generated, True, in_place=True)
        here = live.ticket.hop  # (the router answers with the same Ticket, its hop changed in place)

        def answered(nt: Ticket, live: Live) -> None:
            if nt.hop == here:
                live.ticket, live.produced, live.export_after = nt, 0, nt.export_after
                return
            if live.req.rid in e.seqs:
                e.remove(live.req.rid)
            self.at(self.now + self._handoff_s(live), self._enter, nt, live)

        self._call(self.router.advance(live.ticket, end), answered, live)

    def _move(self, live: Live, outcome: str) -> None:
        end = HopEnd(outcome, self.now - live.hop_t, live.generated, live.generated > 0)
        delay = self._handoff_s(live) if outcome == "handoff" else 0.0
        self._call(self.router.advance(live.ticket, end), lambda nt, lv: self.at(self.now + delay, self._enter, nt, lv),
                   live)

    def _handoff_s(self, live: Live) -> float:
        kv = (live.req.prompt_tokens + live.generated) * self.spec.kv_bytes_per_token
        return self.spec.handoff_fixed_s + kv / self.spec.handoff_bw_bytes_s

    # ---- reports, snapshots, recalls ---------------------------------------------------------
    def _report(self) -> None:
        for e in self.hops.values():
            self.state.report(e.report(self.now))
        self.at(self.now + REPORT_EVERY_S, self._report)

    def _refresh(self) -> None:
        self.router.take_snapshot(self.state.snapshot())
        self.router._release_held()
        self.at(self.now + REFRESH_EVERY_S, self._refresh)

    def _recall(self) -> None:
        """As each CPU pool does: its requests queued unstarted for RECALL_AFTER_S, offered to the
        router every RECALL_EVERY_S."""
        for e in self.hops.values():
            if e.pool != "cpu":
                continue
            due = [self.live[r] for r in e.waiting_unstarted()
                   if r in self.live and self.now - self.live[r].hop_t >= RECALL_AFTER_S]
            if due:
                self._call(self.router.recall([lv.ticket for lv in due]), self._recalled, e, due)
        if self.live or self._q:
            self.at(self.now + RECALL_EVERY_S, self._recall)

    def _recalled(self, ids, e: SimEngine, due: list[Live]) -> None:
        for live in due:
            if ids and live.req.rid in ids and live.req.rid in e.waiting_unstarted():
                e.remove(live.req.rid, SeqStatus.FINISHED_ABORTED)
                live.segments.pop()  # it never ran there
                self._move(live, "withdrawn")
