"""A hand-off whose KV object died with its owner is prefilled again, not failed."""
from __future__ import annotations

import asyncio
import time

import ray

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.serve.messages import GenerateRequest, Handoff, SegmentStart, TokenChunk
from keyacc_ray.serve import pools as pools_mod
from keyacc_ray.serve.pools import EnginePool
from tests.conftest import tiny_model
from tests.helpers import PROMPTS, hf_greedy


@ray.remote(num_cpus=0)
class Owner:
    def put(self, obj):
        return [ray.put(obj)]  # nested: the caller gets the ref, this actor stays its owner


def exported(rid: str, prompt: str, after: int):
    """A greedy 20-token request on the tiny Qwen3, exported after `after` tokens: (model path,
    params, prompt ids, the tokens made, the package)."""
    path = tiny_model("qwen3")
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    src = LLMEngine(EngineConfig(model=path))
    ids = src.tokenize(prompt)
    src.add_request(rid, ids, params)
    first = []
    while len(first) < after:
        first += [t for o in src.step() for t in o.new_token_ids]
    pkg = src.export_request(rid)
    assert pkg.meta.num_kv_tokens > 0
    return path, params, ids, first, pkg


def test_kv_owner_died_before_read_prefills_again(app_url, monkeypatch):  # app_url: a running Ray cluster
    path, params, ids, first, pkg = exported("r", PROMPTS[4], 6)

    owner = Owner.remote()
    ref = ray.get(owner.put.remote((pkg.keys, pkg.values)), timeout=30)[0]
    ray.kill(owner)
    time.sleep(1.0)
    handoff = Handoff(pkg.request_id, pkg.meta, [ref], pkg.token_ids, pkg.num_prompt_tokens, pkg.params,
                      pkg.rng_state, pkg.emitted_text_chars, pkg.nbytes)
    pool = EnginePool(EngineConfig(model=path).__dict__, deployment="TestPool")
    try:
        req = GenerateRequest("r", ids, params.to_dict())

        async def run():
            out = []
            async for items in pool.generate(req, handoff):
                out += [t for i in items if isinstance(i, TokenChunk) for t in i.token_ids]
            return out

        rest = asyncio.run(asyncio.wait_for(run(), 60))
        # the same hand-off as the pools send it, by directory key, whose reference never
        # arrived (the directory restarted, say): prefilled again after the take times out
        keyed = Handoff(pkg.request_id, pkg.meta, [], pkg.token_ids, pkg.num_prompt_tokens, pkg.params,
                        pkg.rng_state, pkg.emitted_text_chars, pkg.nbytes, kv_key="r/never-put")
        monkeypatch.setattr(pools_mod, "KV_TAKE_TIMEOUT_S", 0.5)
        handoff = keyed
        rest_keyed = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        pool.loop.shutdown()
    assert first + rest == hf_greedy(path, ids, 20)
    assert first + rest_keyed == hf_greedy(path, ids, 20)


async def _hop(pool, req, handoff):
    """One hop through the pool: (its tokens, its SegmentStart's kv)."""
    out, kv = [], None
    async for items in pool.generate(req, handoff):
        out += [t for i in items if isinstance(i, TokenChunk) for t in i.token_ids]
        kv = next((i.kv for i in items if isinstance(i, SegmentStart)), kv)
    return out, kv


def test_a_hop_cancelled_before_its_first_token_gives_its_kv_back(app_url, monkeypatch):
    """A hop its driver gave up on (not taken within the bound: the replica took it just then)
    took the hand-off's KV from the directory; cancelled before its sequence made a token there,
    it gives the KV back under its key, and the driver's next hop takes it: decoded on from the
    KV, not prefilled again (the 2x-overload soak's "KV not found ... prefilling again" after
    every such stall), with generate()'s tokens."""
    monkeypatch.setattr(pools_mod, "KV_TAKE_TIMEOUT_S", 2.0)
    path, params, ids, first, pkg = exported("g", PROMPTS[2], 5)
    pool = EnginePool(EngineConfig(model=path).__dict__, deployment="TestPool")
    try:
        ray.get(pool._directory().put.remote("g/1", [ray.put((pkg.keys, pkg.values))]), timeout=30)
        handoff = Handoff(pkg.request_id, pkg.meta, [], pkg.token_ids, pkg.num_prompt_tokens, pkg.params,
                          pkg.rng_state, pkg.emitted_text_chars, pkg.nbytes, kv_key="g/1")
        req = GenerateRequest("g", ids, params.to_dict())

        async def cancelled():  # the driver's cancellation lands once the hop has its KV, before a token
            gen = pool.generate(req, handoff)
            seen = []
            async for items in gen:
                seen += items
                if any(isinstance(i, SegmentStart) for i in items):
                    break
            await gen.aclose()
            return seen

        seen = asyncio.run(asyncio.wait_for(cancelled(), 60))
        assert [i.kv for i in seen if isinstance(i, SegmentStart)] == ["received"]
        assert not any(isinstance(i, TokenChunk) for i in seen)
        rest, kv = asyncio.run(asyncio.wait_for(_hop(pool, req, handoff), 60))
    finally:
        pool.loop.shutdown()
    assert kv == "received"  # the KV given back, not a prefill of prompt + tokens again
    assert first + rest == hf_greedy(path, ids, 20)


def test_a_hop_cancelled_after_its_tokens_began_lets_the_next_hop_take_its_kv_at_once(app_url, monkeypatch):
    """Cancelled once its sequence made tokens there (the client never got them: the driver had
    given up on the hop), a hop gives nothing back, and the driver's next hop does not wait out
    KV_TAKE_TIMEOUT_S (here 20 s): the directory answers it with the references that hop took
    (kept for a second take: the KV is still where the client's stream is), so it imports them
    instead of prefilling again: generate()'s tokens, well within that wait; and nothing is left
    under the key."""
    monkeypatch.setattr(pools_mod, "KV_TAKE_TIMEOUT_S", 20.0)
    path, params, ids, first, pkg = exported("u", PROMPTS[3], 5)
    pool = EnginePool(EngineConfig(model=path).__dict__, deployment="TestPool")
    directory = pool._directory()
    try:
        ray.get(directory.put.remote("u/1", [ray.put((pkg.keys, pkg.values))]), timeout=30)
        handoff = Handoff(pkg.request_id, pkg.meta, [], pkg.token_ids, pkg.num_prompt_tokens, pkg.params,
                          pkg.rng_state, pkg.emitted_text_chars, pkg.nbytes, kv_key="u/1")
        req = GenerateRequest("u", ids, params.to_dict())

        async def cancelled_after_a_token():
            gen = pool.generate(req, handoff)
            async for items in gen:
                if any(isinstance(i, TokenChunk) for i in items):
                    break
            await gen.aclose()

        asyncio.run(asyncio.wait_for(cancelled_after_a_token(), 60))
        deadline = time.monotonic() + 10
        while ray.get(directory.num_given_back.remote(), timeout=10) < 1:  # (a fire-and-forget call)
            assert time.monotonic() < deadline, "the hop gave nothing back"
            time.sleep(0.05)
        t0 = time.monotonic()
        rest, kv = asyncio.run(asyncio.wait_for(_hop(pool, req, handoff), 60))
        took = time.monotonic() - t0
    finally:
        pool.loop.shutdown()
    assert kv == "received" and took < 10.0  # (not 20 s of waiting first)
    assert ray.get(directory.size.remote(), timeout=10) == 0  # nothing left under the key
    assert first + rest == hf_greedy(path, ids, 20)
