"""A BENCHMARK STAND-IN for LLMEngine, for measuring the serving stack alone
(scripts/bench_stack.py): no model, no KV. Every running sequence gets one token every
1 / tokens_per_s seconds (the step sleeps until then: the engine thread costs no CPU), its text a
fixed short string, until it has `max_tokens`. What remains is the stack's own cost per streamed
token: the engine loop's streams, the pool's Serve side, the router, the ingress, the proxy.

A pool replica runs it instead of LLMEngine only where the replica's environment names it
(`KEYACC_TOKEN_SOURCE=<tokens per second per sequence>`, which only the stack benchmark sets), and
says so in its log and device label. No test of engine behaviour uses it; it has no hand-offs."""
from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

from keyacc_ray.engine.llm_engine import EngineStats, RequestOutput
from keyacc_ray.errors import InvalidRequest, Overloaded

ENV = "KEYACC_TOKEN_SOURCE"
TOKEN_ID, TOKEN_TEXT = 100, " tok"


class _Device:
    type = "cpu"


class TokenSourceEngine:
    def __init__(self, config, tokens_per_s: float):
        self.config = config
        self.tick_s = 1.0 / tokens_per_s
        label = f"TOKEN SOURCE (benchmark stand-in, no model): {tokens_per_s:g} tokens/s per sequence"
        self.runner = SimpleNamespace(device=_Device(), dtype="none", device_label=lambda: label)
        self.blocks = SimpleNamespace(num_blocks=1 << 20, block_size=16, num_free_blocks=1 << 20)
        self.seqs: dict[str, list[int]] = {}  # running: request id -> [prompt tokens, generated, max_tokens]
        self.waiting: deque = deque()
        self.move_on_preempt: set[str] = set()
        self.preempt_exports: list = []
        self.tokens_generated = 0
        self._next = 0.0

    def add_request(self, request_id: str, prompt, params) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise Overloaded("the token source's waiting queue is full")
        self.waiting.append((request_id, [len(prompt), 0, params.max_tokens]))

    def import_request(self, pkg, request_id=None, params=None):
        raise InvalidRequest("the token source (a benchmark stand-in) takes no hand-offs")

    def export_request(self, request_id: str, *a, **k):
        raise InvalidRequest("the token source (a benchmark stand-in) makes no hand-offs")

    def kv_meta(self, *a, **k):
        raise InvalidRequest("the token source (a benchmark stand-in) has no KV")

    def abort(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
        self.waiting = deque(w for w in self.waiting if w[0] != request_id)

    def withdraw(self, request_id: str) -> bool:
        return False

    def has_unfinished(self) -> bool:
        return bool(self.seqs or self.waiting)

    def step(self) -> list[RequestOutput]:
        """Admits what fits, sleeps until the next tick, then one token for every running sequence."""
        while self.waiting and len(self.seqs) < self.config.max_num_seqs:
            rid, st = self.waiting.popleft()
            self.seqs[rid] = st
        now = time.monotonic()
        if self._next > now:
            time.sleep(self._next - now)
        self._next = max(now, self._next) + self.tick_s
        outs = []
        for rid, st in list(self.seqs.items()):
            st[1] += 1
            done = st[1] >= st[2]
            outs.append(RequestOutput(rid, [TOKEN_ID], TOKEN_TEXT, done, "length" if done else None, st[0], st[1]))
            if done:
                del self.seqs[rid]
        self.tokens_generated += len(outs)
        return outs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.seqs), len(self.waiting), self.blocks.num_free_blocks, self.blocks.num_blocks,
                           self.blocks.block_size, self.config.max_num_seqs, self.tokens_generated,
                           self.runner.device_label(), max_waiting=self.config.max_waiting)
