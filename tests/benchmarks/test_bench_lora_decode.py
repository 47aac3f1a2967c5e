"""bench_lora_decode's smoke run (tiny shapes; eager on the CPU under the interpreter, graphed on a GPU):
every variant's step computes the same logits as the "serial" design's, the adapters change them, and
the table and JSON hold one row per variant."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_lora_decode
from kernels import lora_fused
from stages.worker.lora import tiles

pytestmark = pytest.mark.timeout(180)


def test_smoke_run_compares_the_designs(tmp_path):
    bench_lora_decode.main(
        [str(tmp_path), "--smoke", "--cases", "8b:5:3", "--designs", "serial,fused,side", "--rank", "7"]
    )
    summary = json.loads((tmp_path / "lora_decode.json").read_text())
    (case,) = summary["cases"]
    assert (case["preset"], case["batch"], case["adapters"], case["rank"]) == ("tiny", 5, 3, 7)
    rows = {r["variant"]: r for r in case["rows"]}
    assert list(rows) == ["base-only", "serial", "fused", "side"]
    assert case["lora_logits_max_change"] > 1e-3  # the adapters are in the step
    for name in ("fused", "side"):  # bf16 rounding of a different but equal sum, at most
        assert rows[name]["logits_max_diff_vs_serial"] < 1e-2 * case["lora_logits_max_change"], name
    assert all(r["us"] > 0 for r in rows.values())
    assert "| tiny b5 3x r7 | fused |" in (tmp_path / "lora_decode.txt").read_text()


def test_ab_knobs_reach_the_step_and_are_put_back(tmp_path):
    before = tiles.TILE_CLASSES, lora_fused.PROGRAMS_PER_SM
    args = ["--smoke", "--cases", "8b:5:3", "--designs", "serial,fused", "--rank", "7"]
    bench_lora_decode.main([str(tmp_path), *args, "--tile-classes", "2", "--fused-programs-per-sm", "1"])
    assert (tiles.TILE_CLASSES, lora_fused.PROGRAMS_PER_SM) == before
    (case,) = json.loads((tmp_path / "lora_decode.json").read_text())["cases"]
    rows = {r["variant"]: r for r in case["rows"]}
    # 3 one-token tiles of a 5-token batch: classes (2, 5) with the knob; 3 fits class 2's grid of 3
    assert rows["serial"]["tile_class"] == rows["fused"]["tile_class"] == 2
    assert rows["fused"]["logits_max_diff_vs_serial"] < 1e-2 * case["lora_logits_max_change"]
