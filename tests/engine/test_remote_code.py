"""A model repository with its own Python code (`auto_map` in config.json, as many hub models
ship): refused unless trust_remote_code is set, then loaded through the same from_pretrained
path and decoding exactly like transformers' generate() of that code."""
import json
import shutil

import pytest
import torch

from keyacc_ray.config import EngineConfig
from keyacc_ray.engine.llm_engine import LLMEngine
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.errors import ModelLoadError

CONFIG_PY = '''
from transformers import LlamaConfig


class HouseConfig(LlamaConfig):
    model_type = "keyacc-house"
'''
MODELING_PY = '''
from transformers import LlamaForCausalLM

from .configuration_house import HouseConfig


class HouseForCausalLM(LlamaForCausalLM):
    config_class = HouseConfig
'''


@pytest.fixture(scope="module")
def house_model(tmp_path_factory, llama_path):
    d = tmp_path_factory.mktemp("house")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "model.safetensors", "generation_config.json"):
        try:
            shutil.copy(f"{llama_path}/{f}", d / f)
        except FileNotFoundError:
            pass
    cfg = json.loads(open(f"{llama_path}/config.json").read())
    cfg.update(model_type="keyacc-house", architectures=["HouseForCausalLM"],
               auto_map={"AutoConfig": "configuration_house.HouseConfig",
                         "AutoModelForCausalLM": "modeling_house.HouseForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "configuration_house.py").write_text(CONFIG_PY)
    (d / "modeling_house.py").write_text(MODELING_PY)
    return str(d)


def test_remote_code_needs_the_flag_then_matches_generate(house_model):
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        LLMEngine(EngineConfig(model=house_model, max_num_seqs=2))
    eng = LLMEngine(EngineConfig(model=house_model, max_num_seqs=4, trust_remote_code=True))
    assert type(eng.runner.model).__name__ == "HouseForCausalLM"
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(house_model, trust_remote_code=True).eval()
    prompt = eng.tokenize("Hello, world!")
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, min_new_tokens=10)[0, len(prompt):].tolist()
    assert eng.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0] == ref
