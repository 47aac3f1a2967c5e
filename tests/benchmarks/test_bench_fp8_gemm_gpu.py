"""On a GPU: bench_fp8_gemm end to end on one projection at a few token counts (no sweep): every path
timed, the weight-only kernel's output within bf16 rounding of float32 products of the dequantized
weights, and every time at most what the bytes floor allows (a fraction above one would mean a wrong
floor or a kernel that skipped work). Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_fp8_gemm
from kernels.fp8_gemm import MAX_M, TILE_MAX_M

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]


def test_bench_runs_and_checks(tmp_path):
    ms = [1, MAX_M, MAX_M + 1]
    bench_fp8_gemm.main([str(tmp_path), "--shapes", "o", "--ms", *map(str, ms), "--iters", "5", "--no-sweep"])
    r = json.loads((tmp_path / "fp8_gemm.json").read_text())
    assert [row["m"] for row in r["rows"]] == ms and r["bandwidth_gb_s"] > 100
    for row in r["rows"]:
        assert all(row[k] > 0 for k in ("bf16_us", "quant_us", "scaled_mm_us", "fp8_linear_us"))
        assert all(0 < f < 1.2 for f in row["floor_frac"].values()), row["floor_frac"]
        assert ("w8a16_us" in row) == (row["m"] <= TILE_MAX_M)
        if row["m"] <= TILE_MAX_M:
            assert row["w8a16_rel_err"] < 4e-3 and row["w8a16_cast_rel_err"] < 4e-3
            assert row["w8a8_rel_err"] < 6e-2  # e4m3 activations
