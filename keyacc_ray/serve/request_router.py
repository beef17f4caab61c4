"""The pools' Serve request routers: power of two choices, with prefix affinity
(`serve/prefix_affinity.py`) for prompts and hand-offs where a pool has several replicas, and in both a
subscription to a replica's multiplexed token stream (`serve/mux.py`) sent to the replica it
names, and the calls waiting for a full replica taken in `priority` order (token streams' control,
then streams under way, then new requests). Thin shells over Ray Serve's RequestRouter API (alpha
in Ray 2.60); set for every pool deployment by `serve/app.py` (`prefix_affinity` in a pool's config)."""
from __future__ import annotations

import itertools

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from keyacc_ray.serve.messages import GenerateRequest
from keyacc_ray.serve.mux import is_subscribe
from keyacc_ray.serve.prefix_affinity import PrefixAffinity, anchors

CLASS_PATH = "keyacc_ray.serve.request_router:PrefixAffinityRouter"
MUX_CLASS_PATH = "keyacc_ray.serve.request_router:MuxRouter"


def _target(candidate_replicas, pending_request):
    """A subscription's replica, as the only choice ([] if it is not among the candidates: then
    any replica takes the call, refuses it, and the ingress asks again later)."""
    sub = is_subscribe(getattr(pending_request, "args", None) or ())
    if sub is None:
        return None
    return [[r] for r in candidate_replicas if r.replica_id.unique_id == sub.replica][:1] or \
        [list(candidate_replicas)]


def _prompt(pending_request) -> list[int] | None:
    """A request's prompt token ids (a fresh prompt, or a hand-off: its KV lands on the head
    the replica caches, and may have left it out; any other call: None)."""
    args = getattr(pending_request, "args", None) or ()
    if not args or not isinstance(args[0], GenerateRequest):
        return None
    return args[0].prompt_token_ids


# how far into the queue of calls waiting for a replica a call that goes first is looked for
PRIORITY_SCAN = 256


def priority(pending_request) -> int:
    """0: a token stream's subscription or ack (serve/mux.py); 1: a hop of a stream under way (it
    comes with a hand-off: a move, a failover; its client has tokens and waits between two); 2:
    anything else (a request's first hop)."""
    args = getattr(pending_request, "args", None) or ()
    if is_subscribe(args):
        return 0
    if len(args) > 1 and isinstance(args[0], GenerateRequest) and args[1] is not None:
        return 1
    return 2


class UnderWayFirst:
    """Calls queued for a full replica are routed in `priority` order, and in the order they came
    within one: Serve routes a deployment's calls in the order they came
    (`_get_next_pending_request_to_route`), and at twice the capacity with GPU kills (1) an ack
    waited ~1 s behind queued hops for a place at its replica while the replica held that stream's
    tokens back for it (flow control), and (2) streams failed over or handed off to the CPU pool
    waited ~2 s behind new requests for a place there: the 2x soak's stalls. The engine already
    schedules streams under way before fresh prompts (engine/scheduler.py); this is the same
    order one queue earlier. The override of a private method of Ray 2.60's RequestRouter
    (tests/serve/test_mux.py checks it is there); without it, the queue's order as before."""

    def _get_next_pending_request_to_route(self):
        queue = self._pending_requests_to_route
        first = None
        for i, pr in enumerate(itertools.islice(queue, PRIORITY_SCAN)):
            if pr.future.done():
                continue
            rank = priority(pr)
            if rank == 0:
                first = i
                break
            if rank == 1 and first is None:
                first = i
        if first is not None:
            pr = queue[first]
            del queue[first]
            return pr
        return super()._get_next_pending_request_to_route()


class PrefixAffinityRouter(UnderWayFirst, LocalityMixin, MultiplexMixin, RequestRouter):
    """Not FIFO (as Ray Serve LLM's prefix router): the replica chosen for a request serves that
    request, so that an affine choice is not handed to whichever request waits longest."""

    def initialize_state(self, block_size: int = 16, imbalance: int = 4, **kwargs):
        self.affinity = PrefixAffinity(block_size, imbalance)
        self.num_affine = 0  # requests sent where their prefix was last sent

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        target = _target(candidate_replicas, pending_request)
        if target is not None:
            return target
        prompt = _prompt(pending_request) if len(candidate_replicas) > 1 else None
        if prompt:
            keys = anchors(prompt, self.affinity.block_size)
            pending_request.keyacc_anchors = keys  # for on_request_routed
            if keys:
                cache = self._replica_queue_len_cache
                by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
                best = self.affinity.preferred(keys, {i: cache.get(r.replica_id) for i, r in by_id.items()})
                if best is not None:
                    self.num_affine += 1
                    rest = await self._two_choices(candidate_replicas, pending_request)
                    return [[by_id[best]], *rest]  # the affine replica first, if it takes the request
        return await self._two_choices(candidate_replicas, pending_request)

    async def _two_choices(self, candidate_replicas, pending_request):
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        keys = getattr(pending_request, "keyacc_anchors", None)
        if keys:
            self.affinity.record(keys, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)


class MuxRouter(UnderWayFirst, PowerOfTwoChoicesRequestRouter):
    """Serve's default (power of two choices), but in `priority` order, and a subscription goes to
    its replica. Every pool's router where prefix affinity is off."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        target = _target(candidate_replicas, pending_request)
        if target is not None:
            return target
        return await super().choose_replicas(candidate_replicas, pending_request)
