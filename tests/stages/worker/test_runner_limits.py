"""The runner refuses a context its rotary tables do not cover (a gather past them would read out of
bounds on the device: a device-side assert that kills the worker)."""

from __future__ import annotations

import json

import pytest

from stages.worker.runner import ModelRunner, RunnerConfig


def test_max_model_len_beyond_the_models_positions_is_refused(tiny_llama):
    positions = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"max_model_len {positions + 1} exceeds .* {positions}"):
        ModelRunner(RunnerConfig(model_dir=str(tiny_llama), dtype="float32", max_model_len=positions + 1))
    runner = ModelRunner(RunnerConfig(model_dir=str(tiny_llama), dtype="float32", max_model_len=positions))
    assert runner.max_context <= positions


def test_the_offline_engine_refuses_it_too(tiny_llama):
    from runtime.offline import LLM

    positions = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"max_model_len {positions + 1} exceeds .* {positions}"):
        LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=positions + 1)
