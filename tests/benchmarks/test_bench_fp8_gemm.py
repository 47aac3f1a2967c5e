"""bench_fp8_gemm's sweep grid on the CPU: at every token count it holds the config serving chooses, only
tiles whose token side covers the batch and whose pipeline fits an H100's shared memory, and no split
whose slices are shorter than a block."""

from __future__ import annotations

import pytest

from benchmarks.bench_fp8_gemm import SHAPES, candidates
from kernels.fp8_gemm import TILE_MAX_M, choose_config


@pytest.mark.parametrize("m", [1, 16, 17, TILE_MAX_M, 2 * TILE_MAX_M])
def test_sweep_grid(m):
    for _, n, k in SHAPES:
        grid = candidates(m, n, k, 132)
        assert len(grid) == len(set(grid)) and len(grid) >= 8
        assert (choose_config(m, n, k, 132) in grid) == (m <= TILE_MAX_M)
        for c in grid:
            assert c.block_m >= m and c.block_m < 2 * max(m, 16)
            assert c.num_stages * (c.block_n * c.block_k + c.block_m * c.block_k * 2) <= 200 << 10
            assert 1 <= c.split and k // c.split >= c.block_k
