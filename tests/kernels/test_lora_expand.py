"""lora_expand against a float64 torch computation: q/k/v of unequal widths (not multiples of 16), ranks
per slot (1, odd, 0), base-only tokens, NaN in stale B rows and in v entries that must not be read, and
output rows/slices that must stay bit-for-bit untouched."""

from __future__ import annotations

import pytest
import torch

from kernels.batch_info import BatchInfoBuilder
from kernels.lora_expand import ExpandConfig, lora_expand, lora_expand_ref
from runtime.common.lora_layout import LoraLayout
from tests.kernels.conftest import (
    MIXED_LENGTHS,
    MIXED_SLOTS,
    TOL,
    indptr_of,
    random_slot_tables,
    rel_err,
    small_layout,
)


def make_v(gen, indptr, seg_slots, ranks, splits, block_rank):
    """fp32 partials [splits, T, N, block_rank] as the shrink leaves them: random below the rank, zeros
    up to the next multiple of 16, NaN (never written) elsewhere."""
    T, num_slices = indptr[-1], ranks.shape[1]
    v = torch.full((splits, T, num_slices, block_rank), float("nan"))
    for i, slot in enumerate(seg_slots):
        lo, hi = indptr[i], indptr[i + 1]
        for s in range(num_slices):
            r = int(ranks[slot, s]) if slot >= 0 else 0
            v[:, lo:hi, s, :r] = torch.randn((splits, hi - lo, r), generator=gen)
            v[:, lo:hi, s, r : (r + 15) // 16 * 16] = 0.0
    return v


def expected_expand(out0, v, b, ranks, scalings, offsets, dims, indptr, seg_slots):
    """float64 result and the mask of output entries the kernel may change."""
    ref = out0.double().clone()
    touched = torch.zeros(out0.shape, dtype=torch.bool)
    vsum = v.sum(0).to(b.dtype).double()  # the kernel feeds v to the dot in the weight dtype
    for i, slot in enumerate(seg_slots):
        lo, hi = indptr[i], indptr[i + 1]
        if slot < 0 or hi == lo:
            continue
        for s, (off, w) in enumerate(zip(offsets, dims, strict=True)):
            r = int(ranks[slot, s])
            if r == 0:
                continue
            delta = vsum[lo:hi, s, :r] @ b[slot, :r, off : off + w].double()
            ref[lo:hi, off : off + w] += float(scalings[slot, s]) * delta
            touched[lo:hi, off : off + w] = True
    return ref, touched


def run_case(device, dtype, group_name, lengths, seg_slots, block_m, config, splits, seed):
    gen = torch.Generator().manual_seed(seed)
    layout = small_layout()
    g = layout.group(group_name)
    mem, ranks_all, scal_all = random_slot_tables(gen, layout, 5, dtype)
    layer = (seed + 1) % layout.num_layers
    sl = slice(g.first_slice, g.first_slice + g.num_slices)
    b_cpu = LoraLayout.b_view(mem, layer, g)  # [S, R, out_total] strided
    ranks_cpu, scal_cpu = ranks_all[:, layer, sl], scal_all[:, layer, sl]
    indptr = indptr_of(lengths)
    used = [s for s in seg_slots if s >= 0]
    info = BatchInfoBuilder(128, device).build(indptr, seg_slots, int(ranks_all[used].max()), block_m=block_m)
    v = make_v(gen, indptr, seg_slots, ranks_cpu, splits, info.block_rank)
    out0 = torch.randn((indptr[-1], g.out_total), generator=gen).to(dtype)

    mem_d = mem.to(device)
    out = out0.to(device, copy=True)
    args = (
        LoraLayout.b_view(mem_d, layer, g),
        ranks_all.to(device)[:, layer, sl],
        scal_all.to(device)[:, layer, sl],
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


@pytest.mark.parametrize(
    "block_m,config,splits",
    [
        (16, ExpandConfig(block_n=16, block_k=16), 1),  # several rank steps, narrow column blocks
        (16, ExpandConfig(block_n=32, block_k=32, num_warps=2), 3),  # split-K partials summed
        (32, ExpandConfig(block_n=64, block_k=16, num_stages=3), 2),  # a block wider than the k/v slices
        (64, ExpandConfig(block_n=16, block_k=32), 1),
    ],
)
def test_expand_block_shapes(device, block_m, config, splits):
    run_case(device, torch.bfloat16, "qkv", MIXED_LENGTHS, MIXED_SLOTS, block_m, config, splits, seed=block_m)


def test_expand_decode_distinct_adapters(device):
    lengths = [1] * 9
    slots = [0, 1, -1, 2, 3, 4, 0, -1, 2]
    run_case(device, torch.bfloat16, "qkv", lengths, slots, 16, ExpandConfig(32, 16), splits=4, seed=5)


def test_expand_rejects_bad_inputs(device):
    layout = small_layout()
    g = layout.group("qkv")
    mem = torch.randn((2, layout.num_layers, layout.max_rank, layout.row_elems), device=device)
    b = LoraLayout.b_view(mem, 0, g)
    ranks = torch.ones((2, 3), dtype=torch.int32, device=device)
    scal = torch.ones((2, 3), device=device)
    info = BatchInfoBuilder(16, device).build([0, 4], [1], 1)
    v = torch.zeros((1, 4, 3, info.block_rank), device=device)
    out = torch.zeros((4, g.out_total), device=device)
    offs, dims = g.out_offsets, g.out_dims
    with pytest.raises(ValueError, match="float32"):
        lora_expand(v.half(), b, ranks, scal, out, offs, dims, info)
    with pytest.raises(ValueError, match="scalings"):
        lora_expand(v, b, ranks, scal.double(), out, offs, dims, info)
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand(v, b, ranks, scal, out, offs, (dims[0], dims[1], dims[2] + 1), info)
    with pytest.raises(ValueError, match="dtype"):
        lora_expand(v, b, ranks, scal, out.half(), offs, dims, info)
    with pytest.raises(ValueError, match="block_k"):
        lora_expand(v, b, ranks, scal, out, offs, dims, info, config=ExpandConfig(16, 48))
