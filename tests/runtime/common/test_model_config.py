"""A base model the runtime cannot run exactly is refused when its config is read, naming what is wrong."""

from __future__ import annotations

import json

import pytest

from runtime.common.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError


@pytest.fixture(scope="module")
def llama_config(tiny_llama) -> dict:
    return json.loads((tiny_llama / "config.json").read_text())


def test_tiny_llama_config_is_accepted(llama_config):
    cfg = ModelConfig.from_dict(llama_config)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.num_layers == llama_config["num_hidden_layers"]


def test_unsupported_architecture(llama_config):
    c = {**llama_config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(ModelConfigError, match="unsupported architecture 'GPT2LMHeadModel'") as e:
        ModelConfig.from_dict(c)
    assert isinstance(e.value, ValueError)
    assert all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_model_type_without_architectures(llama_config):
    c = {**llama_config, "architectures": None, "model_type": "gpt_neox"}
    with pytest.raises(ModelConfigError, match="unsupported architecture 'gpt_neox'"):
        ModelConfig.from_dict(c)


def test_unsupported_activation(llama_config):
    with pytest.raises(ModelConfigError, match="unsupported hidden_act 'gelu'"):
        ModelConfig.from_dict({**llama_config, "hidden_act": "gelu"})


def test_unsupported_rope_scaling(llama_config):
    c = {**llama_config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}
    with pytest.raises(ModelConfigError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_dict(c)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
