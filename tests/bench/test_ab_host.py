"""scripts/ab_host.py: another commit's engine beside this tree's in one process."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_other_commit_runs_as_a_package_of_its_own(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from ab_host import other_package
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    name = other_package("HEAD", tmp_path)
    kernels = tmp_path / name / "kernels" / "__init__.py"
    sources = [p.read_text() for p in (tmp_path / name).rglob("*.py") if p != kernels]
    assert sources and not any("keyacc_ray" in s for s in sources)
    assert any("from keyacc_ab." in s for s in sources)
    assert "from keyacc_ray import kernels" in kernels.read_text()  # one kernel build, this tree's


def test_ab_host_compares_both_engines(qwen3_path):
    r = subprocess.run([sys.executable, "scripts/ab_host.py", "--against", "HEAD", "--model", qwen3_path,
                        "--batch", "4", "--modes", "greedy", "topp", "--rounds", "2", "--steps", "3",
                        "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["against"] == "HEAD"
    for key in ("host_ms_b4_greedy", "host_ms_b4_topp"):
        assert res[key]["this"] > 0 and res[key]["other"] > 0
