"""lora_expand_silu_mul (the gate_up expand fused into the activation for row blocks of one adapter, the
plain expand for the other rows) against a float64 torch computation: silu(gate + delta) * (up + delta)
with each adapter's own weights, over batches with long runs (one-adapter blocks), one-token runs of
different adapters, base-only rows, graph padding, ranks 1, odd, 0 and above 64, split-K partials, NaN in
stale B rows and unwritten v entries, the adapter rows read from slot memory or a scattered pool. Also
the host's per-block adapter ids, and what the expand leaves to the fused kernel."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kernels.batch_info import ACT_BLOCK_M, BatchInfoBuilder, block_slots, plan_runs
from kernels.lora_expand import ExpandConfig
from kernels.lora_expand_act import ExpandActConfig, lora_expand_silu_mul, lora_expand_silu_mul_ref
from runtime.common.lora_layout import LoraLayout
from tests.kernels.conftest import (
    LARGE_CHOICES,
    LARGE_FIRST,
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

# Runs of 40 and 33 rows (whole blocks of one adapter), one-token runs of three adapters side by side, a
# base-only row, an empty segment, runs that end inside a block, and slot 4 (rank 0 everywhere).
LENGTHS = [40, 1, 1, 1, 0, 33, 1, 2, 18, 5, 20]
SLOTS = [0, 1, 2, 3, 1, 2, -1, 0, 3, 4, 1]


def rows_slots(indptr, seg_slots, cover):
    """Each row's adapter id (-1: none), row by row."""
    out = [-1] * cover
    for i, s in enumerate(seg_slots):
        for t in range(indptr[i], indptr[i + 1]):
            out[t] = s
    return out


def test_block_slots_name_the_one_adapter_of_each_block():
    gen = np.random.default_rng(0)
    for _ in range(50):
        n = int(gen.integers(1, 12))
        lengths = gen.integers(0, 40, n).tolist()
        seg_slots = gen.integers(-1, 4, n).tolist()
        indptr = indptr_of(lengths)
        cover = indptr[-1] + int(gen.integers(0, 40))
        rows = rows_slots(indptr, seg_slots, cover)
        want = []
        for b in range(-(-cover // ACT_BLOCK_M)):
            block = set(rows[b * ACT_BLOCK_M : (b + 1) * ACT_BLOCK_M])
            want.append(block.pop() if len(block) == 1 and min(block) >= 0 else -1)
        assert block_slots(plan_runs(indptr, seg_slots), cover).tolist() == want


def run_case(device, dtype, seed, block_m=16, splits=1, pad=0, pool="slots", tables=None, config=None):
    gen = torch.Generator().manual_seed(seed)
    max_rank, *rank_args = tables or (24,)
    layout = small_layout(max_rank=max_rank)
    g = layout.group("gate_up")
    inter = g.out_dims[0]
    mem, ranks_all, scal_all = random_slot_tables(gen, layout, 6 if tables else 5, dtype, (4,), *rank_args)
    layer = seed % layout.num_layers
    sl = slice(g.first_slice, g.first_slice + 2)
    indptr = indptr_of(LENGTHS)
    T = indptr[-1] + pad
    used = [s for s in SLOTS if s >= 0]
    info = BatchInfoBuilder(256, device).build(
        indptr, SLOTS, int(ranks_all[used].max()), block_m=block_m, cover=T
    )
    info = dataclasses.replace(info, num_tokens=T)  # a padded batch: rows past the tokens have no adapter
    padded = (indptr + [T], SLOTS + [-1]) if pad else (indptr, SLOTS)  # padding: a segment of no adapter
    v = make_v(gen, *padded, ranks_all[:, layer, sl], splits, info.block_rank)
    gate_up0 = torch.randn((T, g.out_total), generator=gen).to(dtype)
    base, rows = pool_operands(gen, mem, ranks_all, layout, pool, device)
    args = (
        v.to(device),
        LoraLayout.b_rows(layer_rows(base, layer, pool), g),
        ranks_all.to(device)[:, layer, sl],
        scal_all.to(device)[:, layer, sl],
        rows,
    )
    gate_up = gate_up0.to(device, copy=True)
    act = lora_expand_silu_mul(*args, gate_up, info, config=config).cpu()

    full, touched = expected_expand(
        gate_up0,
        v,
        LoraLayout.b_view(mem, layer, g),
        ranks_all[:, layer, sl],
        scal_all[:, layer, sl],
        g.out_offsets,
        g.out_dims,
        indptr,
        SLOTS,
    )
    gate, up = full.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up  # float64
    assert act.shape == (T, inter) and act.dtype == dtype
    assert torch.isfinite(act).all(), "read a stale B row or an unwritten v entry"
    assert rel_err(act, want) < 2 * TOL[dtype], rel_err(act, want)

    # What the plain expand did: the rows of one-adapter blocks are the fused kernel's and left alone,
    # every other adapter row has its delta.
    rows_of = torch.tensor(rows_slots(indptr, SLOTS, T))
    uniform = torch.tensor(block_slots(plan_runs(indptr, SLOTS), T)).repeat_interleave(ACT_BLOCK_M)[:T] >= 0
    assert uniform.any() and (~uniform & (rows_of >= 0)).any()  # both kinds of rows are in the batch
    changed = gate_up.cpu()
    assert torch.equal(changed[uniform], gate_up0[uniform])
    mixed = (~uniform)[:, None] & touched
    assert torch.equal(changed[~mixed], gate_up0[~mixed])
    err = rel_err(changed[mixed] - gate_up0[mixed].double(), full[mixed] - gate_up0[mixed].double())
    assert err < 2 * TOL[dtype], err

    plain = lora_expand_silu_mul_ref(*args, gate_up0.to(device), info).cpu()  # the unfused torch path
    assert rel_err(plain, want) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_m", [16, 64])
def test_fused_matches_float64(device, dtype, block_m):
    run_case(device, dtype, seed=1, block_m=block_m)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pad", [0, 21])
def test_fused_split_partials_and_padding(device, splits, pad):
    run_case(device, torch.bfloat16, seed=2, splits=splits, pad=pad)


def test_fused_scattered_pool_and_large_ranks(device):
    """Ranks above 64 (a 128 rank tile, two rank chunks a dot) read through a scattered pool whose
    unused table entries point at NaN rows."""
    run_case(device, torch.float32, seed=3, pool="scattered", tables=(128, LARGE_FIRST, LARGE_CHOICES))


def test_fused_narrow_blocks_and_small_rank_steps(device):
    cfg = ExpandActConfig(
        expand=ExpandConfig(block_n=32, block_k=16), act=ExpandConfig(block_n=32, block_k=16, num_warps=2)
    )
    run_case(device, torch.bfloat16, seed=4, splits=2, pool="scattered", config=cfg)


def test_fused_rejects_bad_inputs(device):
    layout = small_layout()
    g = layout.group("gate_up")
    indptr = indptr_of(LENGTHS)
    T = indptr[-1]
    info = BatchInfoBuilder(256, device).build(indptr, SLOTS, 24)
    mem = torch.zeros((5, layout.num_layers, layout.max_rank, layout.row_elems), device=device)
    b = LoraLayout.b_rows(LoraLayout.slot_rows(mem, 0), g)
    ranks = torch.zeros((5, 2), dtype=torch.int32, device=device)
    scal = torch.zeros((5, 2), device=device)
    rows = layout.slot_row_table(5, device)
    v = torch.zeros((1, T, 2, info.block_rank), device=device)
    gate_up = torch.zeros((T, g.out_total), device=device)
    with pytest.raises(ValueError, match="v must be"):
        lora_expand_silu_mul(v[:, :, :1], b, ranks, scal, rows, gate_up, info)
    with pytest.raises(ValueError, match="do not match the batch"):
        lora_expand_silu_mul(v[:, :-1], b, ranks, scal, rows, gate_up[:-1], info)
    padded = dataclasses.replace(info, num_tokens=T + 32)  # metadata planned for T rows only
    v_pad = torch.zeros((1, T + 32, 2, info.block_rank), device=device)
    with pytest.raises(ValueError, match="blocks of 16 rows, too few"):
        lora_expand_silu_mul(
            v_pad, b, ranks, scal, rows, torch.zeros((T + 32, g.out_total), device=device), padded
        )
    with pytest.raises(ValueError, match="ranks must be"):
        lora_expand_silu_mul(v, b, ranks[:, :1], scal, rows, gate_up, info)
    with pytest.raises(ValueError, match="B rows must be"):
        lora_expand_silu_mul(v, b[:, :10], ranks, scal, rows, gate_up, info)
