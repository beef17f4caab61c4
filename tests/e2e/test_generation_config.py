"""A model that ships sampling defaults in its generation_config.json (as most instruct models
do: a repetition penalty, a temperature, top-k / top-p): the server takes them as vLLM does, so
a greedy request through the whole graph, on every route, gets transformers' generate() tokens,
which apply the same file. Redeploys the session's app on such a model, then back. (That app also
runs the GPU pools disaggregated, `gpu_prefill: disaggregated`: GpuPrefill replicas prefill and
hand the KV to GpuDecode through the object store, the path of a host with GPUs for each.)"""
from __future__ import annotations

import json
import shutil

import httpx
import pytest
from ray import serve

from keyacc_ray.serve.app import build_app
from tests.conftest import tiny_model
from tests.e2e.conftest import APP_ARGS, wait_for_monitor
from tests.helpers import PROMPTS, hf_greedy, hf_model


@pytest.fixture(scope="module")
def gc_app(app_url, tmp_path_factory):
    model = tmp_path_factory.mktemp("gc") / "tiny-qwen3-gc"
    shutil.copytree(tiny_model("qwen3"), model)
    gc = json.loads((model / "generation_config.json").read_text())
    gc.update(repetition_penalty=1.3, temperature=0.7, top_k=20, max_new_tokens=12, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(gc))
    serve.run(build_app({**APP_ARGS, "model": str(model), "gpu_prefill": "disaggregated"}), name="keyacc",
              route_prefix="/")
    wait_for_monitor(app_url, deployments=("GpuPrefill", "GpuDecode", "CpuDecode"))
    yield app_url, str(model)
    serve.run(build_app(APP_ARGS), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)


@pytest.mark.parametrize("route", ["gpu", "cpu", "stage"])
def test_greedy_takes_the_models_repetition_penalty_like_generate(gc_app, route):
    url, model = gc_app
    _, tok = hf_model(model)
    for prompt in PROMPTS[:3]:
        body = {"model": "tiny-qwen3-gc", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "keyacc": {"route": route}}
        r = httpx.post(f"{url}/v1/completions", timeout=60, json=body)
        assert r.status_code == 200, r.text
        ids = tok(prompt)["input_ids"]
        with_penalty = hf_greedy(model, ids, 24)  # generate() applies the file's repetition_penalty 1.3
        assert r.json()["choices"][0]["token_ids"] == with_penalty
        segs = [(s["deployment"], s["phase"], s.get("kv")) for s in r.json()["keyacc"]["segments"]]
        if route == "gpu":  # disaggregated: prefilled on GpuPrefill, its KV decoded on by GpuDecode
            assert segs == [("GpuPrefill", "prefill", None), ("GpuDecode", "decode", "received")]
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={**body, "repetition_penalty": 1.0})
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny_model("qwen3"), ids, 24)  # the request's own
    assert with_penalty != hf_greedy(tiny_model("qwen3"), ids, 24)  # the penalty changes this output


def test_chat_without_max_tokens_gets_the_models_max_new_tokens(gc_app):
    url, _ = gc_app
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-qwen3-gc", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
