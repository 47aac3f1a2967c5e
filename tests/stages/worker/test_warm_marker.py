"""The compile cache's marker (warm_marker.py): one file per runner set-up, named by everything the kernels
are chosen from, written only for a start-up that compiled nothing in the worker, removed by one that
did, and ignored when unreadable. (The warm-up that reads it runs on the GPU: test_compile_cache_gpu.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.common.model_config import ModelConfig
from stages.worker.runner_config import RunnerConfig
from stages.worker.warm_marker import WarmMarker

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    return tmp_path / "triton"


def _cfg(tiny_llama, **kw) -> RunnerConfig:
    return RunnerConfig(model_dir=str(tiny_llama), warmup=True, **kw)


def test_the_name_follows_every_input(tiny_llama, tiny_qwen2, cache):
    model = ModelConfig.from_dir(tiny_llama)
    base = WarmMarker(_cfg(tiny_llama), model, CPU)
    assert base.path == cache / f"lorapipe-warm-{base.digest}.json"
    assert WarmMarker(_cfg(tiny_llama), model, CPU).digest == base.digest
    others = [
        WarmMarker(_cfg(tiny_llama, max_lora_rank=16), model, CPU),
        WarmMarker(_cfg(tiny_llama, cuda_graph_max_tokens=256), model, CPU),
        WarmMarker(_cfg(tiny_llama), ModelConfig.from_dir(tiny_qwen2), CPU),
        WarmMarker(_cfg(tiny_llama), dataclasses.replace(model, num_layers=model.num_layers + 1), CPU),
    ]
    assert len({base.digest, *(m.digest for m in others)}) == 1 + len(others)


def test_written_only_for_a_start_up_that_compiled_nothing(tiny_llama, cache):
    marker = WarmMarker(_cfg(tiny_llama), ModelConfig.from_dir(tiny_llama), CPU)
    assert not marker.complete() and not marker.holds("p1")
    marker.settle("p1", clean=False)  # compiled something: nothing written
    assert not marker.complete() and not cache.exists()
    marker.settle("p1", clean=True)
    assert marker.complete() and marker.holds("p1") and not marker.holds("p2")
    again = WarmMarker(_cfg(tiny_llama), ModelConfig.from_dir(tiny_llama), CPU)  # the next start
    assert again.complete() and again.holds("p1")
    again.settle("p2", clean=True)  # another plan (a KV cache of another size)
    assert marker.holds("p2") and not marker.holds("p1")
    again.settle("p2", clean=False)  # a kernel was missing after all: the next start uses the pool
    assert not marker.path.exists() and not marker.complete()
    assert [p.name for p in cache.iterdir()] == []  # no temporary file left


def test_an_unreadable_marker_is_ignored(tiny_llama, cache, caplog):
    marker = WarmMarker(_cfg(tiny_llama), ModelConfig.from_dir(tiny_llama), CPU)
    cache.mkdir()
    for text in ("{not json", '{"plan": 3}', "[]"):
        marker.path.write_text(text)
        assert not marker.complete() and not marker.holds("3")
    assert "unreadable" in caplog.text
    marker.settle("p", clean=True)  # replaced by a good one
    assert marker.holds("p")


def test_no_cache_directory_no_marker(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    marker = WarmMarker(_cfg(tiny_llama), ModelConfig.from_dir(tiny_llama), CPU)
    assert marker.path is None and not marker.complete()
    marker.settle("p", clean=True)  # nowhere to write: nothing happens
    assert list(tmp_path.iterdir()) == []
