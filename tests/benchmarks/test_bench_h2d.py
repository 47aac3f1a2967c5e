"""bench_h2d on the CPU (host clock; numbers mean nothing here): adapter sizes become ranks, every slot
path copies the right bytes, the report and table have their shape, the targets apply only from their
size, and bad arguments fail clearly. The 8b sizes of the issue map to ranks 4, 13 and 64."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_h2d
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.synthetic.model import build_config

pytestmark = pytest.mark.timeout(120)


def test_issue_sizes_map_to_ranks_on_the_8b_layout(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(build_config("llama", "8b", dtype="bfloat16")))
    per_rank = LoraLayout.for_model(ModelConfig.from_dir(tmp_path), 1).block_bytes(1, torch.bfloat16)
    assert per_rank == 5 << 20  # 32 layers x 81920 elements x 2 bytes
    assert [bench_h2d.rank_for(mb, per_rank) for mb in (16, 64, 335)] == [4, 13, 64]
    assert bench_h2d.rank_for(0.001, per_rank) == 1


def test_cpu_run_report_and_table(tiny_llama, tmp_path, capsys):
    out = tmp_path / "h2d.json"
    args = ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32", "--sizes-mb", "0.01,0.03"]
    args += ["--reps", "2", "--warmup", "1", "--peak-mb", "1", "--work-dir", str(tmp_path), "--out", str(out)]
    report = bench_h2d.main(args)
    assert json.loads(out.read_text()) == report and report["device"] == "cpu"
    assert report["peak"]["nbytes"] == 1_000_000 and len(report["peak"]["ms"]) == 2
    rows = report["adapters"]
    assert [r["rank"] for r in rows] == [2, 4] and [r["nbytes"] for r in rows] == [17920, 35840]
    for r in rows:
        assert r["verified"] and r["pool_verified"] and r["num_layers"] == 2
        assert r["tensor_gbps"] > 0 and r["pool_gbps"] > 0 and r["dma_only_gbps"] is None
        assert r["layered_gbps"] > 0 and r["issue_ms_busy"] > 0
        assert r["met"] is None  # below --target-min-mb: no verdict
        assert len(r["tensor_ms"]) == len(r["pool_ms"]) == 2
    table = capsys.readouterr().out
    assert "pinned→device peak (cpu" in table and "\n| r2 | 2 |" in table and "\n| r4 | 4 |" in table
    assert not list(tmp_path.glob("bench_h2d-*"))  # generated adapters are removed


def test_targets_and_no_pool(tiny_llama, tmp_path):
    args = ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32", "--sizes-mb", "0.01"]
    args += ["--reps", "1", "--peak-mb", "0.1", "--no-pool", "--target-min-mb", "0"]
    easy = bench_h2d.main([*args, "--target-ratio", "0", "--target-gbps", "0"])["adapters"][0]
    assert easy["met"] is True and "pool_gbps" not in easy
    hard = bench_h2d.main([*args, "--target-gbps", "1e9"])["adapters"][0]
    assert hard["met"] is False
    assert "**no**" in bench_h2d.format_table({"device": "x", "timing": "t", "peak": {"nbytes": 1, "gbps": 1,
                                                "ms": [1]}, "adapters": [hard]})  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    [["--reps", "0"], ["--sizes-mb", "16,-1"], ["--sizes-mb", "x"], ["--peak-mb", "0"]],
    ids=["reps", "negative-size", "not-a-number", "peak"],
)
def test_bad_arguments(tiny_llama, bad, capsys):
    with pytest.raises(SystemExit):
        bench_h2d.main(["--model", str(tiny_llama), "--device", "cpu", *bad])
    assert "error" in capsys.readouterr().err


def test_model_without_config(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_h2d.main(["--model", str(tmp_path), "--device", "cpu"])
    assert "no config.json" in capsys.readouterr().err
