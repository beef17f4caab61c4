"""One real Ray cluster + Serve app (the default graph on the tiny model) for the e2e tests."""
from __future__ import annotations

import os
import socket
import time

import httpx
import pytest

from tests.conftest import tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(args: dict, port: int):
    import ray
    from ray import serve

    from keyacc_ray.serve.app import apply_cluster_env, build_app

    apply_cluster_env()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=bool(os.environ.get("KEYACC_TEST_LOGS")),
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    for attempt in range(3):
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            break
        except Exception as e:  # noqa: BLE001 - the free port was taken before the proxy bound it
            if "Address already in use" not in str(e) or attempt == 2:
                raise
            serve.shutdown()
            port = free_port()
    serve.run(build_app(args), name="keyacc", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        raise TimeoutError("the Serve app did not come up in 180 s")
    wait_for_monitor(base)
    return base


def wait_for_monitor(base: str, timeout_s: float = 120, headers: dict | None = None,
                     deployments=("GpuDecode", "CpuDecode")) -> None:
    """Until the app answers and every pool has reported to the load monitor (GpuPrefill has no
    replica in the default, colocated app: one GPU engine serves both phases)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"{base}/metrics", timeout=10, headers=headers).text
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        if all(f'deployment="{d}"' in text for d in deployments):
            return
        time.sleep(0.3)
    raise TimeoutError("pools did not report to the load monitor")


def replica_counter(app_url: str, name: str, deployment: str) -> float:
    """A per-replica series of /metrics, summed over the deployment's replicas."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{app_url}/metrics", timeout=10).text.splitlines()
               if line.startswith(name + "{") and f'deployment="{deployment}"' in line)


def stop_app():
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


# As deployments/app.yaml: a context (1024) larger than the emulated GPU's KV budget (48 x 16 =
# 768 tokens), so the app serves a context of 768.
APP_ARGS = {"model": tiny_model("qwen3"), "max_model_len": 1024}
SERVED_CONTEXT = 768


@pytest.fixture(scope="session")
def app_url():
    base = start_app(APP_ARGS, free_port())
    yield base
    stop_app()
