"""KEYACC_STEP_TRACE_DIR: every engine step recorded (rows, prompt tokens, KV read, imports, wall
and thread CPU), and scripts/step_trace_report.py reading the records against a step profile."""
import importlib.util
import json

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.engine.step_trace import ENV
from keyacc_ray.sim.steptime import StepTime
from tests.conftest import ROOT


def test_every_step_is_recorded_with_what_it_held(qwen3_path, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "trace"))
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, dtype="float32"))
    eng.label_step_trace("gpu")  # (a pool replica names its pool: the co-run fit tells the engines apart by it)
    prompts = [[5 + i for i in range(12)], [7 + i for i in range(20)]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = eng.generate(prompts, params)
    assert [len(o) for o in out] == [6, 6]
    b = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=4, dtype="float32"))  # the same process: one file
    b.label_step_trace("cpu")
    eng.add_request("m", prompts[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()
    b.import_request(eng.export_request("m"), "m")
    while b.has_unfinished():
        b.step()
    files = list((tmp_path / "trace").glob("steps-*.jsonl"))
    assert len(files) == 1
    steps = [json.loads(line) for line in files[0].read_text().splitlines()]
    # the prompts' tokens once each, a decode row for every token after a request's first
    assert sum(s["prompt_tokens"] for s in steps) == 12 + 20 + 12
    assert sum(s["rows"] for s in steps) == 2 * 5 + 7
    assert sum(s["imports"] for s in steps) == 1
    imported = next(s for s in steps if s["imports"])
    assert imported["kv_tokens"] >= 12 and imported["prompt_tokens"] == 0  # it decodes on the KV it brought
    assert imported["pool"] == "cpu" and steps[0]["pool"] == "gpu"
    assert all(s["wall_s"] >= 0 and s["cpu_s"] >= 0 and s["attn_pairs"] >= s["prompt_tokens"] for s in steps)

    spec = importlib.util.spec_from_file_location("step_trace_report", ROOT / "scripts" / "step_trace_report.py")
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    for s in steps:  # two runs, 10 s apart
        s["t"] = 100.0 + (10.0 if s["imports"] or steps.index(s) > steps.index(imported) else 0.0)
    runs = rep.runs_of(steps, gap_s=2.0)
    assert len(runs) == 2 and sum(len(r) for r in runs) == len(steps)
    model = StepTime("m", 0.001, 0.0001, 0.0005, 0.0)
    got = rep.summary(runs[0], model)
    pred = sum(model.seconds(s["prompt_tokens"], s["rows"], s["kv_tokens"], s["attn_pairs"]) for s in runs[0])
    assert got["steps"] == len(runs[0]) and got["cpu_vs_model"] == round(sum(s["cpu_s"] for s in runs[0]) / pred, 3)


def test_no_trace_without_the_variable(qwen3_path, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    eng = LLMEngine(EngineConfig(model=qwen3_path, max_num_seqs=2, dtype="float32"))
    assert eng._step_trace is None
    eng.label_step_trace("cpu")  # nothing to name
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
