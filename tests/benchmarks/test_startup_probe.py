"""The start-up probe (benchmarks/startup_probe.py) times each part in a fresh interpreter and writes its
table and JSON; on the CPU it has no CUDA parts, and the launcher's path imports no torch (fp8 weights
and tensor parallelism asked for too)."""

from __future__ import annotations

import json

import pytest

from benchmarks.startup_probe import main


@pytest.mark.timeout(120)
def test_the_probe_times_every_part(tiny_llama, llama_adapters, tmp_path, capsys):
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    for i, path in enumerate(llama_adapters.values()):
        (adapters / f"adapter{i}").symlink_to(path)
    argv = [str(tmp_path / "out"), "--model", str(tiny_llama), "--adapters", str(adapters)]
    argv += ["--num-adapters", str(len(llama_adapters)), "--device", "cpu", "--reps", "1"]
    argv += ["--serve-args", "--quantization fp8 --tensor-parallel-size 2"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "out" / "startup_probe.json").read_text())
    assert list(result) == ["launcher to spawn", "import torch", "worker imports"]
    assert result["launcher to spawn"]["torch_imported"] is False
    assert all(row["median_s"] > 0 and len(row["runs_s"]) == 1 for row in result.values())
    assert "| launcher to spawn |" in capsys.readouterr().out
