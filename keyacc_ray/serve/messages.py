"""Typed messages that cross a process boundary between ingress, router and pools.

A pool's `generate` stream yields lists of these items: `HopAccepted`, one `SegmentStart`, then `TokenChunk`s
(in CPU decode periods, a `TicketUpdate` after each period's check), and at the end either a
finished `TokenChunk`, a `Handoff` (the sequence stops here and goes on elsewhere) or an
`ErrorItem`. Nothing here is ever built from client bytes by unpickling:
the ingress parses JSON into `GenerateRequest`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keyacc_ray.serve.prefix_affinity import PREFIX_BLOCK, anchors


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams fields
    route: str | None = None  # pinned route: "gpu", "cpu" or "stage"
    migrate_back_after: int | None = None


@dataclass
class HopAccepted:
    """A pool's first item of every hop, before it fetches a hand-off's KV: its replica took the
    call (out of Serve's queue). The driver bounds only this wait for a stream under way."""


@dataclass
class SegmentStart:
    pool: str  # "gpu" or "cpu"
    phase: str  # "prefill" or "decode"
    replica: str
    deployment: str
    node: str = ""  # the Ray node id the replica runs on
    kv: str = ""  # with a hand-off: "received" (its KV arrived) or "recomputed" (prefilled again)


@dataclass
class HopTimings:
    """The last item of a hop's stream from its engine: where its tokens waited, in the replica.
    `made_gap_ms`: the longest time between two of its tokens leaving the engine's steps (a slow
    step, a wait for a place or for blocks); `made_gap_after`: how many tokens the hop had made
    before it; `loop_lag_ms`: the longest time a step's tokens waited for the replica's event loop
    after the engine thread handed them over; `mux_wait_ms`: how long its multiplexed token stream
    held batches back while the hop ran, waiting for the ingress replica to say it read the ones before
    (serve/mux.py's flow control; 0 on a hop not multiplexed)."""
    made_gap_ms: float
    made_gap_after: int
    loop_lag_ms: float
    mux_wait_ms: float = 0.0


@dataclass
class TokenChunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list | None = None  # per token: (logprob, [(id, logprob) alternatives]), where asked for
    prompt_logprobs: list | None = None  # with a request's first token, where asked for (LLMEngine's RequestOutput)
    num_cached_tokens: int = 0  # prompt tokens this hop's engine found in its prefix cache

    def __reduce__(self):  # a tuple of its fields: several times cheaper to pickle than its __dict__
        return TokenChunk, (self.token_ids, self.text, self.finish_reason, self.num_prompt_tokens,
                            self.num_output_tokens, self.logprobs, self.prompt_logprobs, self.num_cached_tokens)


def merge_chunks(items: list) -> list:
    """Consecutive TokenChunks as one (tokens and text joined, the last one's counts and finish
    reason): a batch read after a wait crosses every later hop, and becomes one SSE event, as one
    item instead of one per token. Other items keep their place."""
    out: list = []
    for item in items:
        prev = out[-1] if out else None
        if isinstance(item, TokenChunk) and isinstance(prev, TokenChunk) and prev.finish_reason is None:
            lps = None if prev.logprobs is None and item.logprobs is None else \
                (prev.logprobs or []) + (item.logprobs or [])
            out[-1] = TokenChunk(prev.token_ids + item.token_ids, prev.text + item.text, item.finish_reason,
                                 item.num_prompt_tokens, item.num_output_tokens, lps,
                                 prev.prompt_logprobs or item.prompt_logprobs,
                                 max(prev.num_cached_tokens, item.num_cached_tokens))
        else:
            out.append(item)
    return out


@dataclass
class Withdrawn:
    """The last item of a hop's stream: the request left the pool's queue before it ever ran
    there (recalled by the router to start over where a place is free now)."""


@dataclass
class ErrorItem:
    status_code: int
    body: dict  # {"error": {...}} in OpenAI's shape


@dataclass
class Handoff:
    """A sequence's state between two engines. Only the K/V arrays go through the object store:
    their reference waits in the KV directory under `kv_key` (the hand-off itself may travel
    pickled, over gRPC), or travels as `kv_ref` (a one-element list, passed along by Ray, not
    resolved). The small state travels inline, so if the KV object is lost the receiver can
    prefill prompt + tokens so far."""

    request_id: str
    meta: Any  # KVMeta
    kv_ref: list  # [ObjectRef of (keys, values)], or [] when there is no KV to pass
    token_ids: list[int]
    num_prompt_tokens: int
    params: dict
    rng_state: np.ndarray | None
    emitted_text_chars: int
    kv_bytes: int = 0
    kv_key: str = ""  # the KV directory's key for the reference, when it waits there

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class Trace:
    """Where a request ran: the `keyacc` object of a response."""

    segments: list[dict] = field(default_factory=list)

    def start(self, s: SegmentStart) -> bool:
        """A hop's replica says where it runs; True if that begins a new segment."""
        last = self.segments[-1] if self.segments else None
        if last and s.phase == "decode" and (last["replica"], last["deployment"]) == (s.replica, s.deployment):
            last["periods"] += 1  # the next decode period on the same replica: not a move
            if s.kv == "recomputed":
                last["kv"] = "recomputed"
            return False
        self.segments.append({"pool": s.pool, "phase": s.phase, "replica": s.replica,
                              "deployment": s.deployment, "node": s.node, "tokens": 0, "periods": 1})
        if s.kv:
            self.segments[-1]["kv"] = s.kv
        return True

    def add_tokens(self, n: int) -> None:
        if self.segments:
            self.segments[-1]["tokens"] += n

    def hop_timings(self, t: HopTimings) -> None:
        """A hop's timings in its replica, into its segment (the longest over the segment's hops)."""
        if self.segments:
            seg = self.segments[-1]
            if t.made_gap_ms > seg.get("made_gap_ms", -1.0):
                seg["made_gap_ms"], seg["made_gap_after"] = t.made_gap_ms, t.made_gap_after
            seg["loop_lag_ms"] = max(seg.get("loop_lag_ms", 0.0), t.loop_lag_ms)
            if t.mux_wait_ms:
                seg["mux_wait_ms"] = max(seg.get("mux_wait_ms", 0.0), t.mux_wait_ms)

    def token_gap(self, gap_s: float, at_s: float, inbox=None) -> None:
        """The ingress saw no token of the segment for `gap_s`, from `at_s` after the request's start.
        `inbox`: the hop's (serve/mux.py's Inbox): for a token that came on a multiplexed stream,
        how long its batch took from the pool's send to this ingress replica's reader (the
        transport, and the reader's turn in this replica's event loop: `gap_transport_ms`) and from
        the reader to the driver (`gap_local_ms`); None for a token that came on the hop's own call."""
        seg = self.segments[-1] if self.segments else None
        if seg is not None and gap_s * 1e3 > seg.get("ingress_gap_ms", 0.0):
            seg["ingress_gap_ms"], seg["ingress_gap_at_ms"] = round(gap_s * 1e3, 2), round(at_s * 1e3, 2)
            if inbox is not None:
                came = inbox.came()
                seg["gap_transport_ms"], seg["gap_local_ms"] = ((round(came[0] * 1e3, 2), round(came[1] * 1e3, 2))
                                                                if came else (None, None))

    def to_dict(self) -> dict:
        return {"segments": self.segments, "moves": max(0, len(self.segments) - 1)}


@dataclass
class Ticket:
    """A request's routing state between the ingress (which streams it, hop by hop) and the
    router (which decides each hop). The router keeps nothing per request that it cannot lose:
    this travels with every call, so any router replica can answer the next one."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    pinned_route: str | None = None  # the client's pin ("gpu", "cpu", "stage"), if allowed
    migrate_back_after: int | None = None
    route: str = ""  # the first route taken: "gpu", "cpu" or "stage"
    hop: str | None = None  # where to go now: "gpu_prefill", "gpu_decode", "cpu_decode/<i>"; None: stop
    export_after: int | None = None  # hand the sequence off after this many tokens there
    move_on_preempt: bool = False  # preempted there (lazy KV), hand it off rather than recompute it
    # a colocated GPU engine prefills it on its decode hop: its first hand-off or check is the
    # after-prefill decision (stay and decode there, or move the decode to the CPU pool)
    prefill_check: bool = False
    last_cpu: str | None = None  # the CPU deployment of the last CPU period (stay there if possible)
    recoveries: int = 0
    backpressured: bool = False
    refused_since: float = -1.0  # (router's clock) a stream under way refused by full queues since then
    stalls: int = 0  # hops of it not taken in time (past MAX_STALLS: a 503, not a wait without end)
    # its last hop was not taken in time: this one waits for its pool up to NEW_HOP_START_BOUND_S
    # (the hops after it, HOP_START_BOUND_S again: a stream under way)
    stall_moved: bool = False
    error: ErrorItem | None = None  # set: answer with this and stop
    # where its prompt's head is cached (the router's guesses, prefix_affinity.PoolPrefixes): the keys
    # of its heads at a few depths (prefix_affinity.anchors, PREFIX_BLOCK tokens a block, deepest
    # first); the head its hop is expected to cache (a move there decided by a pool's check in place
    # exports the sequence without those blocks' K/V); the head every hop it may go to after this
    # hop's `export_after` tokens is expected to cache (that hand-off leaves it out)
    prefix_keys: tuple = ()
    kv_skip_tokens: int = 0
    export_skip_tokens: int = 0

    @classmethod
    def of(cls, req: GenerateRequest) -> "Ticket":
        return cls(req.request_id, len(req.prompt_token_ids), int(req.params.get("max_tokens", 16)),
                   req.route, req.migrate_back_after,
                   prefix_keys=tuple(anchors(req.prompt_token_ids, PREFIX_BLOCK)))


@dataclass
class TicketUpdate:
    """In a CPU decode period's stream: the router's answer to the pool's check after a period.
    Same hop: the decode goes on where it is (the next period, no hand-off); another hop: the
    stream ends with a `Handoff` and the request goes on there, as this ticket says."""
    ticket: Ticket


# A hop that failed with one of these: its replica's actor died or cannot be reached (Ray's, by
# class name: no Ray import here; ReplicaGoneError: the replica's multiplexed token stream broke
# with one of Ray's, serve/mux.py).
REPLICA_GONE_ERRORS = frozenset({"ActorDiedError", "ActorUnavailableError", "RayActorError", "ReplicaGoneError"})


class ReplicaGoneError(ConnectionError):
    """A hop's replica died under it: what broke its token stream was the replica's actor gone."""


@dataclass
class HopEnd:
    """How a hop ended, as the ingress reports it to the router."""

    outcome: str  # "handoff", "backpressure", "failed", "withdrawn" (recalled unstarted), "stalled" (a stream
    # under way that its pool did not take within the driver's bound), or "done" (finished, errored or cancelled)
    seconds: float
    num_output_tokens: int  # generated so far, over every hop
    has_handoff: bool = False  # the hop was entered with (or, failed, left) a sequence to continue
    error: str = ""  # the exception's class name, when failed
    finished: bool = False  # the request ended by itself (stop or length), not by error or cancel
    # a pool's check while the sequence decodes on where it is (after a CPU period, or after a
    # colocated GPU engine's prefill); the answer may move it. Not in place: the hop has ended.
    in_place: bool = False
    replica: str = ""  # the replica the hop ran on, where it started there (failed: the one that died)
