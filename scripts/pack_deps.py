#!/usr/bin/env python3
"""Pack what a GPU host without network needs beyond torch + transformers into one xz tarball
of unpacked wheels for its Python (default 3.12): Ray 2.60.0 with Serve and their dependencies,
psutil, nvidia-ml-py, httpx, ninja, and matplotlib for the plots. The versions are this
checkout's own (read from the local virtualenv), so the host runs what `make test` tested.

Ray's wheel alone is 79 MB; unpacked and compressed with xz, without the parts the app does not
use (the dashboard's web client, bundled tests, py-spy), everything fits in the 64 MiB a device
run may carry. scripts/gpu_check.sh unpacks it on the host.

    python scripts/pack_deps.py                 # -> dist/deps-py312.tar.xz (git-ignored)
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ["ray", "psutil", "nvidia-ml-py", "httpx", "ninja", "matplotlib"]
EXTRAS = {"ray": {"serve"}}
# On the host already (torch and transformers bring them), or not needed by the app.
SKIP = {"torch", "transformers", "numpy", "pyyaml", "requests", "filelock", "packaging", "jinja2", "markupsafe",
        "certifi", "idna", "charset-normalizer", "urllib3", "fsspec", "sympy", "mpmath",
        "networkx", "tqdm", "huggingface-hub", "safetensors", "tokenizers", "regex", "py-spy", "setuptools",
        "triton"}
DROP = ["ray/dashboard/client", "ray/tests", "ray/serve/tests", "ray/data", "ray/train", "ray/tune", "ray/rllib",
        "ray/air/tests", "ray/jars", "matplotlib/tests", "mpl_toolkits/*/tests", "ray/core/src/ray/gcs/gcs_server.dbg"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> dict[str, str]:
    """name -> installed version for ROOTS and everything they require here."""
    seen: dict[str, str] = {}
    todo = [(r, EXTRAS.get(r, set())) for r in ROOTS]
    while todo:
        name, extras = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = norm(dist.metadata["Name"])
        if key in seen and not extras:
            continue
        seen[key] = dist.version
        for req in dist.requires or []:
            m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?", req)
            marker = req.split(";", 1)[1] if ";" in req else ""
            if "extra ==" in marker and not any(f'extra == "{e}"' in marker for e in extras):
                continue
            if "sys_platform == \"win32\"" in marker or "platform_system == \"Windows\"" in marker:
                continue
            sub = norm(m.group(1))
            sub_extras = set((m.group(2) or "[]")[1:-1].split(",")) - {""}
            if sub not in seen or sub_extras:
                todo.append((sub, sub_extras))
    return {k: v for k, v in seen.items() if k not in SKIP}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="3.12")
    ap.add_argument("--out", default=str(ROOT / "dist" / "deps-py{py}.tar.xz"))
    args = ap.parse_args()
    pins = closure()
    out = Path(args.out.format(py=args.python.replace(".", "")))
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
               "--python-version", args.python, "--implementation", "cp"]
        for plat in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "linux_x86_64"):
            cmd += ["--platform", plat]
        subprocess.run(cmd + [f"{k}=={v}" for k, v in sorted(pins.items())], check=True)
        for whl in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                for info in z.infolist():
                    target = z.extract(info, site)
                    mode = info.external_attr >> 16
                    if mode:
                        Path(target).chmod(mode & 0o777)
        for pattern in DROP:
            for p in site.glob(pattern):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        for p in list(site.rglob("__pycache__")):
            shutil.rmtree(p, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz", preset=9) as tar:
            tar.add(site, arcname="site")
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB, {len(pins)} packages: "
          + " ".join(f"{k}=={v}" for k, v in sorted(pins.items())))


if __name__ == "__main__":
    main()
