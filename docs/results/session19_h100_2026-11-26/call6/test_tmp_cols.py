"""The test call 6 ran with expand_cols.patch applied (as tests/kernels/test_tmp_cols.py): the expand
with `cols` column blocks a program against the float64 reference of tests/kernels/test_lora_expand.py.
Not part of the suite (the patch was not kept)."""

import pytest
import torch

from kernels.lora_expand import ExpandConfig, cols_fit
from tests.kernels.conftest import MIXED_LENGTHS, MIXED_SLOTS, small_layout
from tests.kernels.test_lora_expand import run_case


@pytest.mark.parametrize("group_name", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("bn,cols,splits", [(16, 2, 1), (16, 3, 3), (8, 2, 2), (16, 4, 1)])
@pytest.mark.parametrize("pool", ["slots", "scattered"])
def test_cols(device, group_name, bn, cols, splits, pool):
    g = small_layout(max_rank=24).group(group_name)
    cfg = ExpandConfig(block_n=bn, block_k=32, cols=cols)
    if not cols_fit(cfg, 32, g.out_dims):
        pytest.skip("cols does not divide")
    run_case(device, torch.bfloat16, group_name, MIXED_LENGTHS, MIXED_SLOTS, 16, cfg, splits, 3, pool)
    decode_slots = [0, 1, -1, 2, 3, 4, 0, -1, 2]
    run_case(device, torch.float32, group_name, [1] * 9, decode_slots, 16, cfg, splits, 5, pool)
