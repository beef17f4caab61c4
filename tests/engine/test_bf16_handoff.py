"""bf16: a hand-off mid-decode continues by the tie-aware rule (../shared/NOTES.md): where the
moved run and the uninterrupted run first differ, the moved run's token must be the reference's
argmax or within a few bf16 rounding steps of it (`tests.helpers.tie_aware_equal`; bf16 kernels
round differently; exactness is a float32 property)."""
import subprocess
import sys

import pytest
import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from tests.conftest import ROOT
from tests.helpers import PROMPTS, tie_aware_equal


@pytest.fixture(scope="module")
def bf16_path():
    out = ROOT / "models" / "tiny-llama-bf16"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_model.py"), "--arch", "llama", "--dtype",
                        "bfloat16", "--out", str(out)], check=True, timeout=300)
    return str(out)


@pytest.mark.parametrize("k", [1, 9])
def test_bf16_export_import_mid_decode(bf16_path, k):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    a = LLMEngine(EngineConfig(model=bf16_path, dtype="bfloat16"))
    b = LLMEngine(EngineConfig(model=bf16_path, dtype="bfloat16", kv_block_size=4, kv_export_layout="LTHD"))
    assert a.runner.dtype == torch.bfloat16
    for p in (PROMPTS[3], PROMPTS[8], PROMPTS[12]):
        ids = a.tokenize(p)
        ref = a.generate([ids], params)[0]
        a.add_request("x", ids, params)
        first = []
        while len(first) < k:
            first += [t for o in a.step() for t in o.new_token_ids]
        pkg = a.export_request("x")
        assert pkg.keys.dtype.name == "uint16" and pkg.meta.dtype == "bfloat16"  # bf16 travels as uint16
        b.import_request(pkg)
        rest = []
        while b.has_unfinished():
            rest += [t for o in b.step() for t in o.new_token_ids]
        assert tie_aware_equal(a, ids, ref, first + rest), (ref, first + rest)
