"""Access control: API keys (401 without a valid one), the routing extension restricted to
operators, keys never written to the logs. Redeploys the session's app with keys, then back."""
from __future__ import annotations

import glob
import secrets

import httpx
import openai
import pytest
from ray import serve

from keyacc_ray.serve.app import build_app
from tests.e2e.conftest import APP_ARGS, wait_for_monitor

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def keys(app_url, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    client_key, operator_key = f"sk-client-{secrets.token_hex(8)}", f"sk-op-{secrets.token_hex(8)}"
    (d / "api_keys").write_text(f"# clients\n{client_key}\n")
    (d / "operator_keys").write_text(operator_key + "\n")
    serve.run(build_app({**APP_ARGS, "api_keys_file": str(d / "api_keys"), "operator_keys_file": str(d / "operator_keys"),
                         "allow_route_pinning": "operators"}), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url, headers={"Authorization": f"Bearer {operator_key}"})
    yield client_key, operator_key
    serve.run(build_app(APP_ARGS), name="keyacc", route_prefix="/")
    wait_for_monitor(app_url)


def test_requests_need_a_valid_key(app_url, keys):
    client_key, _ = keys
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": client_key}):
        r = httpx.post(f"{app_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{app_url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{app_url}/health", timeout=10).status_code == 200  # liveness stays open
    assert httpx.get(f"{app_url}/version", timeout=10).status_code == 200  # as vLLM's, without a key
    c = openai.OpenAI(base_url=f"{app_url}/v1", api_key=client_key, max_retries=0, timeout=30)
    assert c.completions.create(model=MODEL, prompt="Hello", max_tokens=4).usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{app_url}/v1", api_key="sk-nope", max_retries=0).models.list()


def test_route_pinning_only_for_operators(app_url, keys):
    client_key, operator_key = keys
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "keyacc": {"route": "cpu"}}
    r = httpx.post(f"{app_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {client_key}"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "keyacc.route"
    r = httpx.post(f"{app_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {operator_key}"},
                   timeout=30)
    assert r.status_code == 200
    assert [s["pool"] for s in r.json()["keyacc"]["segments"]] == ["cpu"]


def test_the_requests_list_is_for_operators(app_url, keys):
    """GET /keyacc/requests (which requests the router counts, where, for how long): no key 401,
    a client's key 403, an operator's 200; a bad limit 400."""
    client_key, operator_key = keys
    url = f"{app_url}/keyacc/requests"
    assert httpx.get(url, timeout=10).status_code == 401
    r = httpx.get(url, headers={"Authorization": f"Bearer {client_key}"}, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    op = {"Authorization": f"Bearer {operator_key}"}
    r = httpx.get(url, headers=op, timeout=10)
    assert r.status_code == 200 and r.json()["object"] == "list" and isinstance(r.json()["data"], list)
    for bad in ("0", "-3", "x", "1001", "2.5"):
        r = httpx.get(url, params={"limit": bad}, headers=op, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit", bad


def test_keys_never_logged(keys):
    client_key, operator_key = keys
    logs = glob.glob("/tmp/ray/session_latest/logs/**/*", recursive=True)
    assert logs
    for path in logs:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (IsADirectoryError, PermissionError, FileNotFoundError):
            continue
        assert client_key.encode() not in data and operator_key.encode() not in data, path
