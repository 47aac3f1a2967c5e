"""`graph_capture.caches_kept`: within it, the cache releases torch.cuda.graph makes before each capture
happen once (each kind), and the real functions are back after it, also when the body raises. (The
captures themselves run on the GPU: test_graph_capture_gpu.py, test_step_graphs_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from stages.worker.graph_capture import caches_kept


def test_each_release_runs_once_within_and_normally_after(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("device"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host"), raising=False)
    real_device, real_host = torch.cuda.empty_cache, torch._C._host_emptyCache
    with caches_kept():
        for _ in range(3):  # what three captures in a row call
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
    assert calls == ["device", "host"]
    assert torch.cuda.empty_cache is real_device and torch._C._host_emptyCache is real_host
    torch.cuda.empty_cache()
    assert calls == ["device", "host", "device"]
    with pytest.raises(RuntimeError), caches_kept():
        raise RuntimeError("a capture failed")
    assert torch.cuda.empty_cache is real_device and torch._C._host_emptyCache is real_host


def test_a_release_torch_lacks_is_left_alone(monkeypatch):
    monkeypatch.delattr(torch._C, "_host_emptyCache", raising=False)
    with caches_kept():
        assert not hasattr(torch._C, "_host_emptyCache")
    assert not hasattr(torch._C, "_host_emptyCache")
