#!/usr/bin/env python3
"""Start a Ray node that describes its hardware, instead of a bare `ray start`.

It discovers the NUMA nodes (and GPUs, with the NUMA node each is attached to) and starts Ray
with custom resources and labels that placement can select by:

  resources  keyacc_numa_<i>: <CPUs on NUMA node i>      one per NUMA node
             keyacc_cpu_node: 1 / keyacc_gpu_node: 1     what kind of node this is
             keyacc_head_node: 1                         on the head: where router and ingress go
  labels     keyacc/numa-nodes=<n>, keyacc/gpus=<n>, keyacc/gpu-numa=<node of GPU 0>

    python scripts/start_node.py --head [-- extra ray start args]
    python scripts/start_node.py --address HEAD:6379 [-- extra ray start args]
    python scripts/start_node.py --print        # show what it would pass, start nothing
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyacc_ray.hw.topology import describe  # noqa: E402
from keyacc_ray.serve.app import apply_cluster_env  # noqa: E402


def node_args(info: dict, kind: str | None, head: bool = False) -> tuple[dict, dict]:
    resources = {f"keyacc_numa_{n['node']}": len(n["cpus"]) for n in info["numa_nodes"]}
    gpus = info["gpu"].get("gpus", []) if info["gpu"].get("available") else []
    kind = kind or ("gpu" if gpus else "cpu")
    resources[f"keyacc_{kind}_node"] = 1
    if head:
        resources["keyacc_head_node"] = 1  # the control plane (router, ingress) stays here
    labels = {"keyacc/numa-nodes": str(len(info["numa_nodes"])), "keyacc/gpus": str(len(gpus)),
              "keyacc/node-kind": kind}
    if gpus and gpus[0].get("numa_node") is not None:
        labels["keyacc/gpu-numa"] = str(gpus[0]["numa_node"])
    return resources, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", action="store_true")
    ap.add_argument("--address", help="the head's address (worker nodes)")
    ap.add_argument("--kind", choices=["gpu", "cpu"], help="override: what kind of node this is")
    ap.add_argument("--print", action="store_true", help="print the ray start command and exit")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: passed to ray start")
    args = ap.parse_args()
    if not args.print and args.head == bool(args.address):
        ap.error("give exactly one of --head or --address")
    info = describe()
    resources, labels = node_args(info, args.kind, args.head)
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    cmd = [ray_bin, "start", f"--address={args.address}" if args.address else "--head",
           f"--resources={json.dumps(resources)}",
           "--labels=" + ",".join(f"{k}={v}" for k, v in labels.items())]
    if args.head:
        # The dashboard and the client ports stay on localhost unless the operator says otherwise.
        cmd += ["--dashboard-host=127.0.0.1"]
    cmd += [a for a in args.extra if a != "--"]
    print(json.dumps({"topology": info, "resources": resources, "labels": labels}, indent=1), file=sys.stderr)
    print(" ".join(cmd))
    if not args.print:
        apply_cluster_env()  # Ray's processes on this node inherit it
        os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
