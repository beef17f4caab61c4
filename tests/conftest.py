"""Shared fixtures: tiny models made by scripts/make_tiny_model.py (no downloads)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Triton kernels (the GPU's decode attention) run on CPU tensors through Triton's interpreter in the
# tests; Triton reads this flag when it is first imported, so it is set before anything imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(arch: str) -> str:
    out = ROOT / "models" / f"tiny-{arch}"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), "--arch", arch,
                        "--size", "tiny", "--out", str(out)], check=True, timeout=300)
    return str(out)


@pytest.fixture(scope="session")
def qwen3_path() -> str:
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def llama_path() -> str:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen2_path() -> str:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def mistral_path() -> str:
    return tiny_model("mistral")
