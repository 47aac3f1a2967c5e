"""lora_expand against a float64 torch computation of each adapter's own weights: q/k/v of unequal widths
(not multiples of 16), ranks per adapter (1, odd, 0, above 64), base-only tokens, NaN in stale B rows and
in v entries that must not be read, output rows/slices that must stay bit-for-bit untouched, adapter rows
read through the row table from slot memory (identity table) or a scattered pool with NaN rows."""

from __future__ import annotations

import pytest
import torch

from kernels.batch_info import BatchInfoBuilder
from kernels.lora_expand import ExpandConfig, lora_expand, lora_expand_ref
from runtime.common.lora_layout import LoraLayout
from tests.kernels.conftest import (
    LARGE_CHOICES,
    LARGE_FIRST,
    MIXED_LENGTHS,
    MIXED_SLOTS,
    TOL,
    expected_expand,
    indptr_of,
    layer_rows,
    make_v,
    pool_operands,
    random_slot_tables,
    rel_err,
    small_layout,
)


def run_case(
    device, dtype, group_name, lengths, seg_slots, block_m, config, splits, seed, pool="slots", tables=None
):
    """`pool`: "slots" (slot memory, identity row table) or "scattered"; `tables`: (max_rank, first,
    choices) of `random_slot_tables` (default: ranks up to 24)."""
    gen = torch.Generator().manual_seed(seed)
    max_rank, *rank_args = tables or (24,)
    layout = small_layout(max_rank=max_rank)
    g = layout.group(group_name)
    mem, ranks_all, scal_all = random_slot_tables(gen, layout, 6 if tables else 5, dtype, (4,), *rank_args)
    layer = (seed + 1) % layout.num_layers
    sl = slice(g.first_slice, g.first_slice + g.num_slices)
    b_cpu = LoraLayout.b_view(mem, layer, g)  # [S, R, out_total] strided: each adapter's own B^T
    ranks_cpu, scal_cpu = ranks_all[:, layer, sl], scal_all[:, layer, sl]
    indptr = indptr_of(lengths)
    used = [s for s in seg_slots if s >= 0]
    info = BatchInfoBuilder(128, device).build(indptr, seg_slots, int(ranks_all[used].max()), block_m=block_m)
    v = make_v(gen, indptr, seg_slots, ranks_cpu, splits, info.block_rank)
    out0 = torch.randn((indptr[-1], g.out_total), generator=gen).to(dtype)

    base, rows = pool_operands(gen, mem, ranks_all, layout, pool, device)
    out = out0.to(device, copy=True)
    args = (
        LoraLayout.b_rows(layer_rows(base, layer, pool), g),  # [P, out_total] strided
        ranks_all.to(device)[:, layer, sl],
        scal_all.to(device)[:, layer, sl],
        rows,
    )
    lora_expand(v.to(device), *args, out, g.out_offsets, g.out_dims, info, config=config)
    out = out.cpu()

    ref, touched = expected_expand(
        out0, v, b_cpu, ranks_cpu, scal_cpu, g.out_offsets, g.out_dims, indptr, seg_slots
    )
    assert torch.equal(out[~touched], out0[~touched]), "expand changed a base-only token or a rank-0 slice"
    assert torch.isfinite(out).all(), "expand read a stale B row or an unwritten v entry"
    err = rel_err(out[touched] - out0[touched].double(), ref[touched] - out0[touched].double())
    assert err < TOL[dtype] * 2, err
    plain = lora_expand_ref(
        v.to(device), *args, out0.clone().to(device), g.out_offsets, g.out_dims, info
    ).cpu()
    assert torch.equal(plain[~touched], out0[~touched])
    assert (
        rel_err(plain[touched] - out0[touched].double(), ref[touched] - out0[touched].double())
        < TOL[dtype] * 2
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_name", ["qkv", "o", "gate_up"])
def test_expand_mixed_batch_default_config(device, dtype, group_name):
    run_case(device, dtype, group_name, MIXED_LENGTHS, MIXED_SLOTS, None, None, splits=1, seed=2)


@pytest.mark.parametrize("group_name", ["qkv", "gate_up"])
def test_expand_scattered_pool(device, group_name):
    """Every adapter's rows scattered over a shared pool, other adapters' and NaN rows in between."""
    run_case(device, torch.bfloat16, group_name, MIXED_LENGTHS, MIXED_SLOTS, None, None, 1, 4, "scattered")


# Ranks above 64 (block rank 128): 80, 100, 128 and small or odd ones mixed; a table as wide as the largest
# rank (128) or narrower than the rank tile (80).
LARGE_TABLES = [(128, LARGE_FIRST, LARGE_CHOICES), (80, (80, 1, 65, 33, 0, 7), (1, 7, 80, 0, 65, 33))]
LARGE_SLOTS = [2, -1, 0, 4, 1, 5, 3, -1, 2, 0]
LARGE_LENGTHS = [3, 2, 5, 1, 4, 2, 17, 1, 3, 1]


@pytest.mark.parametrize("tables", LARGE_TABLES, ids=["width128", "width80"])
@pytest.mark.parametrize("pool", ["slots", "scattered"])
def test_expand_large_ranks(device, tables, pool):
    # default config: one 64-row rank step at a time over a 128 tile
    run_case(device, torch.bfloat16, "qkv", LARGE_LENGTHS, LARGE_SLOTS, None, None, 1, 5, pool, tables)
    # the whole 128-row tile in one step (no rank loop), and 16-row steps over split-K partials
    one_step = ExpandConfig(block_n=32, block_k=128)
    run_case(device, torch.float32, "o", LARGE_LENGTHS, LARGE_SLOTS, 16, one_step, 1, 6, pool, tables)
    run_case(
        device, torch.bfloat16, "o", LARGE_LENGTHS, LARGE_SLOTS, 16, ExpandConfig(64, 16), 3, 7, pool, tables
    )


@pytest.mark.parametrize("pool", ["slots", "scattered"])
@pytest.mark.parametrize(
    "block_m,config,splits",
    [
        (16, ExpandConfig(block_n=16, block_k=16), 1),  # several rank steps, narrow column blocks
        (16, ExpandConfig(block_n=32, block_k=32, num_warps=2), 3),  # split-K partials summed
        (32, ExpandConfig(block_n=64, block_k=16, num_stages=3), 2),  # a block wider than the k/v slices
        (64, ExpandConfig(block_n=16, block_k=32), 1),
    ],
)
def test_expand_block_shapes(device, block_m, config, splits, pool):
    run_case(
        device, torch.bfloat16, "qkv", MIXED_LENGTHS, MIXED_SLOTS, block_m, config, splits, block_m, pool
    )


def test_expand_decode_distinct_adapters(device):
    lengths = [1] * 9
    slots = [0, 1, -1, 2, 3, 4, 0, -1, 2]
    run_case(device, torch.bfloat16, "qkv", lengths, slots, 16, ExpandConfig(32, 16), 4, 5, "scattered")


def test_expand_rejects_bad_inputs(device):
    layout = small_layout()
    g = layout.group("qkv")
    mem = torch.randn((2, layout.num_layers, layout.max_rank, layout.row_elems), device=device)
    b = LoraLayout.b_rows(LoraLayout.slot_rows(mem, 0), g)
    ranks = torch.ones((2, 3), dtype=torch.int32, device=device)
    scal = torch.ones((2, 3), device=device)
    rows = layout.slot_row_table(2, device)
    info = BatchInfoBuilder(16, device).build([0, 4], [1], 1)
    v = torch.zeros((1, 4, 3, info.block_rank), device=device)
    out = torch.zeros((4, g.out_total), device=device)
    offs, dims = g.out_offsets, g.out_dims
    lora_expand(v, b, ranks, scal, rows, out, offs, dims, info)
    with pytest.raises(ValueError, match="float32"):
        lora_expand(v.half(), b, ranks, scal, rows, out, offs, dims, info)
    with pytest.raises(ValueError, match="scalings"):
        lora_expand(v, b, ranks, scal.double(), rows, out, offs, dims, info)
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand(v, b, ranks, scal, rows, out, offs, (dims[0], dims[1], dims[2] + 1), info)
    with pytest.raises(ValueError, match="dtype"):
        lora_expand(v, b, ranks, scal, rows, out.half(), offs, dims, info)
    with pytest.raises(ValueError, match="block_k"):
        lora_expand(v, b, ranks, scal, rows, out, offs, dims, info, config=ExpandConfig(16, 48))
    with pytest.raises(ValueError, match="expected"):
        lora_expand(v, LoraLayout.b_view(mem, 0, g), ranks, scal, rows, out, offs, dims, info)
    with pytest.raises(ValueError, match="int32"):
        lora_expand(v, b, ranks, scal, rows.long(), out, offs, dims, info)
    with pytest.raises(ValueError, match="rows must be"):
        lora_expand(v, b, ranks, scal, rows[:1], out, offs, dims, info)
    with pytest.raises(ValueError, match="covers ranks up to 8"):
        big = BatchInfoBuilder(16, device).build([0, 4], [1], 24)  # rank tile 32 needs ranks above 16
        lora_expand(
            torch.zeros((1, 4, 3, 32), device=device), b, ranks, scal, rows[:, :8], out, offs, dims, big
        )
