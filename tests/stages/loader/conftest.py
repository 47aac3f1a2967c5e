"""Fixtures of the loader tests: a short private run directory (unix socket paths are limited to 107
bytes) and the tiny model's config with its LoRA layout at max rank 16."""

from __future__ import annotations

import shutil

import pytest

from runtime.base.endpoints import make_run_dir
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig

MAX_RANK = 16


@pytest.fixture
def run_dir():
    path = make_run_dir("lpl-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def model(tiny_llama) -> tuple[ModelConfig, LoraLayout]:
    cfg = ModelConfig.from_dir(tiny_llama)
    return cfg, LoraLayout.for_model(cfg, MAX_RANK)
