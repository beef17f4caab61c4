"""NUMA nodes from /sys (falling back to one node), GPUs by pynvml where present."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]"""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


@dataclass
class NumaNode:
    node_id: int
    cpus: list[int]
    mem_total_bytes: int | None


def numa_nodes(root: Path = NODE_ROOT) -> list[NumaNode]:
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((d / "cpulist").read_text())
        except OSError:
            continue
        mem = None
        try:
            for line in (d / "meminfo").read_text().splitlines():
                if "MemTotal" in line:
                    mem = int(line.split()[-2]) * 1024
        except OSError:
            pass
        if cpus:
            nodes.append(NumaNode(int(d.name[4:]), cpus, mem))
    if not nodes:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        nodes = [NumaNode(0, cpus, None)]
    return nodes


def gpu_info() -> dict:
    """GPU utilisation and memory by pynvml; `available: False` (with the reason) where none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver, no library, no device
        return {"available": False, "reason": f"pynvml: {e.__class__.__name__}: {e}"}
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            gpus.append({"index": i, "name": str(pynvml.nvmlDeviceGetName(h)), "util_pct": util.gpu,
                         "mem_used_bytes": mem.used, "mem_free_bytes": mem.free, "mem_total_bytes": mem.total,
                         "numa_node": _gpu_numa_node(pynvml, h)})
        return {"available": bool(gpus), "gpus": gpus}
    except Exception as e:  # noqa: BLE001
        return {"available": False, "reason": f"pynvml: {e}"}


def _gpu_numa_node(pynvml, handle) -> int | None:
    """The NUMA node the GPU's PCI device is attached to, where the system says it."""
    try:
        bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
        bus = (bus.decode() if isinstance(bus, bytes) else bus).lower()
        node = int(Path(f"/sys/bus/pci/devices/{bus[-12:]}/numa_node").read_text().strip())
        return node if node >= 0 else None
    except Exception:  # noqa: BLE001
        return None


def describe() -> dict:
    """Everything the node start script and the logs need, as plain data."""
    return {"numa_nodes": [{"node": n.node_id, "cpus": n.cpus, "mem_total_bytes": n.mem_total_bytes}
                           for n in numa_nodes()],
            "gpu": gpu_info()}


def cpu_load_per_numa(nodes: list[NumaNode] | None = None) -> list[dict]:
    import psutil

    per_cpu = psutil.cpu_percent(percpu=True)
    out = []
    for n in nodes or numa_nodes():
        vals = [per_cpu[c] for c in n.cpus if c < len(per_cpu)]
        out.append({"node": n.node_id, "cpus": len(n.cpus), "util_pct": sum(vals) / max(1, len(vals))})
    return out


def gpu_local_cpus(visible_devices: str | None, gpu: dict, nodes: list[NumaNode]) -> list[int] | None:
    """The CPUs of the NUMA node the (first) visible GPU is attached to, where that is known.
    `visible_devices`: CUDA_VISIBLE_DEVICES as Ray sets it for the replica (physical indices)."""
    if not gpu.get("available") or not visible_devices:
        return None
    try:
        index = int(visible_devices.split(",")[0])
    except ValueError:  # GPU UUIDs: no index to look up
        return None
    numa = next((g.get("numa_node") for g in gpu.get("gpus", []) if g["index"] == index), None)
    node = next((n for n in nodes if n.node_id == numa), None)
    return node.cpus if node is not None else None
