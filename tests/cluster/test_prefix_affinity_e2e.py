"""A pool of two replicas behind the prefix-affinity request router (serve/request_router.py),
through real Ray Serve and HTTP: each prompt sent again lands on the replica that computed it
and is served from its prefix cache, with the same tokens. (With Serve's power of two choices
each repeat would find the other replica half of the time.) Its own Ray, like test_multinode."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest import tiny_model
from tests.helpers import PROMPTS, hf_greedy, hf_model


@pytest.fixture(scope="module")
def two_cpu_replicas():
    from tests.e2e.conftest import free_port, start_app, stop_app

    base = start_app({"model": tiny_model("qwen3"), "max_model_len": 512,
                      "cpu": {"device": "cpu", "replicas": 2, "max_num_seqs": 8, "num_threads": 1, "num_cpus": 0.5}},
                     free_port())
    yield base
    stop_app()


def test_a_repeated_prompt_finds_the_replica_that_cached_it(two_cpu_replicas):
    _, tok = hf_model(tiny_model("qwen3"))
    first_replica = {}
    for rnd in range(2):
        for i in range(8):
            prompt = f"[{i}] " + " ".join(PROMPTS[i:i + 6])
            r = httpx.post(f"{two_cpu_replicas}/v1/completions", timeout=60, json={
                "model": "tiny-qwen3", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "keyacc": {"route": "cpu"}})
            assert r.status_code == 200, r.text
            body = r.json()
            ids = tok(prompt)["input_ids"]
            assert body["choices"][0]["token_ids"] == hf_greedy(tiny_model("qwen3"), ids, 6)
            (seg,) = body["keyacc"]["segments"]
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            if rnd == 0:
                first_replica[i] = seg["replica"]
            else:
                assert seg["replica"] == first_replica[i] and cached == (len(ids) - 1) // 16 * 16 > 0, (i, cached)
    assert len(set(first_replica.values())) == 2  # new prompts still spread over both
