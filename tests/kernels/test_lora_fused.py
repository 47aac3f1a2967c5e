"""The one-launch shrink + expand (`kernels/lora_fused.py`) against the two launches it replaces (with the
same configs: bit for bit under the interpreter) and a float64 computation of each adapter's own weights:
q/k/v of unequal widths, ranks 1, odd, 0 and above 64, base-only and empty-adapter rows, NaN in stale
pool rows, split-K partials, a sync buffer left zero for the next launch; and the backend's "fused"
design against the torch backend, on model-dtype and 8-bit (e4m3, int8) pools."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.batch_info import BatchInfoBuilder
from kernels.lora_expand import expand_config, lora_expand
from kernels.lora_fused import lora_shrink_expand, sync_buffer
from kernels.lora_shrink import lora_shrink, shrink_config
from runtime.common.lora_layout import LoraLayout
from stages.worker.lora.triton_backend import TritonLoraBackend
from tests.kernels.conftest import (
    LARGE_CHOICES,
    LARGE_FIRST,
    MIXED_LENGTHS,
    MIXED_SLOTS,
    TOL,
    indptr_of,
    layer_rows,
    pool_operands,
    random_slot_tables,
    rel_err,
    small_layout,
)
from tests.kernels.test_lora_fp8 import check_backend, fp8_pool
from tests.kernels.test_triton_backend import compare_backends, loaded_pool


def expected(x, mem, ranks, scal, layer, g, indptr, seg_slots) -> torch.Tensor:
    """float64 delta [T, out_total] of each token's adapter (slot memory [S, L, R, row])."""
    a = LoraLayout.a_view(mem, layer, g).double()  # [S, R, n, in]
    b = LoraLayout.b_view(mem, layer, g).double()  # [S, R, out_total]
    delta = torch.zeros((x.shape[0], g.out_total), dtype=torch.float64)
    for i, slot in enumerate(seg_slots):
        lo, hi = indptr[i], indptr[i + 1]
        if slot < 0 or hi == lo:
            continue
        for s, (off, w) in enumerate(zip(g.out_offsets, g.out_dims, strict=True)):
            r = int(ranks[slot, s])
            if r:
                v = x[lo:hi].double() @ a[slot, :r, s].t()
                delta[lo:hi, off : off + w] = float(scal[slot, s]) * (v @ b[slot, :r, off : off + w])
    return delta


@pytest.mark.parametrize(
    "dtype, group_name, tables, split",
    [
        (torch.bfloat16, "qkv", None, 1),
        (torch.bfloat16, "gate_up", None, 2),
        (torch.float32, "o", None, 4),
        (torch.bfloat16, "qkv", (128, LARGE_FIRST, LARGE_CHOICES), 2),
        (torch.float32, "down", (128, LARGE_FIRST, LARGE_CHOICES), 1),
    ],
)
def test_fused_launch_equals_the_two_launches(device, dtype, group_name, tables, split):
    gen = torch.Generator().manual_seed(split + len(group_name))
    max_rank, *rank_args = tables or (24,)
    layout = small_layout(max_rank=max_rank, num_layers=1)
    g = layout.group(group_name)
    mem, ranks_all, scal_all = random_slot_tables(gen, layout, 6 if tables else 5, dtype, (4,), *rank_args)
    sl = slice(g.first_slice, g.first_slice + g.num_slices)
    indptr, seg_slots = indptr_of(MIXED_LENGTHS), MIXED_SLOTS
    T = indptr[-1]
    used = [s for s in seg_slots if s >= 0]
    info = BatchInfoBuilder(128, device).build(indptr, seg_slots, int(ranks_all[used].max()), block_m=16)
    base, rows = pool_operands(gen, mem, ranks_all, layout, "scattered", device)
    rows_l = layer_rows(base, 0, "scattered")
    a, b = LoraLayout.a_rows(rows_l, g), LoraLayout.b_rows(rows_l, g)
    ranks, scal = ranks_all.to(device)[:, 0, sl], scal_all.to(device)[:, 0, sl]
    x = torch.randn((T, g.in_dim), generator=gen).to(dtype).to(device)
    out0 = torch.randn((T, g.out_total), generator=gen).to(dtype).to(device)
    sc = shrink_config(info, g.in_dim, g.num_slices, operand_bytes=(x.element_size(), a.element_size()))
    sc = dataclasses.replace(sc, split_k=split, reduce=False)
    ec = expand_config(info, g.out_dims, split)

    v = lora_shrink(x, a, ranks, rows, info, config=sc)
    two = lora_expand(v, b, ranks, scal, rows, out0.clone(), g.out_offsets, g.out_dims, info, config=ec)
    sync = sync_buffer(info.num_tiles + 3, device)
    scratch = torch.full_like(v, float("nan"))  # the fused launch writes before it reads
    for _ in range(2):  # the second launch finds the sync buffer as the first left it
        one = out0.clone()
        lora_shrink_expand(
            x, a, b, ranks, scal, rows, one, g.out_offsets, g.out_dims, info, v=scratch, sync=sync,
            shrink=sc, expand=ec,
        )  # fmt: skip
        assert not sync.any()
        if device.type == "cpu":  # the interpreter: the same operations in the same order
            assert torch.equal(one, two)
        else:  # compiled separately, the two may order a dot's steps differently: rounding apart
            assert rel_err(one - out0, two - out0) < TOL[dtype] / 4
    want = expected(x.cpu(), mem, ranks_all[:, 0, sl], scal_all[:, 0, sl], 0, g, indptr, seg_slots)
    touched = want != 0
    assert torch.equal(one.cpu()[~touched], out0.cpu()[~touched]), "changed a base-only row or rank-0 slice"
    err = rel_err(one.cpu().double()[touched] - out0.cpu().double()[touched], want[touched])
    assert err < 2 * TOL[dtype], err


def test_fused_launch_checks_its_buffers(device):
    layout = small_layout(num_layers=1)
    g = layout.group("qkv")
    info = BatchInfoBuilder(16, device).build([0, 4], [0], 16)
    pool = torch.zeros((3, layout.row_elems), device=device)
    a, b = LoraLayout.a_rows(pool, g), LoraLayout.b_rows(pool, g)
    ranks = torch.ones((1, 3), dtype=torch.int32, device=device)
    rows = torch.zeros((1, 16), dtype=torch.int32, device=device)
    x, out = torch.zeros((4, g.in_dim), device=device), torch.zeros((4, g.out_total), device=device)
    sc = shrink_config(info, g.in_dim, 3, operand_bytes=(x.element_size(), a.element_size()))
    ec = expand_config(info, g.out_dims)
    v = torch.zeros((sc.split_k, 4, 3, 16), device=device)
    args = (x, a, b, ranks, ranks.float(), rows, out, g.out_offsets, g.out_dims, info)
    with pytest.raises(ValueError, match="sync must be int32"):
        lora_shrink_expand(
            *args, v=v, sync=torch.zeros(1, dtype=torch.int32, device=device), shrink=sc, expand=ec
        )
    with pytest.raises(ValueError, match="v must be contiguous float32"):
        # one partial more than the shrink's split leaves: the expand would sum stale data
        wrong = torch.zeros((sc.split_k + 1, 4, 3, 16), device=device)
        lora_shrink_expand(*args, v=wrong, sync=sync_buffer(4, device), shrink=sc, expand=ec)


def test_fused_design_matches_torch(device):
    """Eager batches (decode-sized: fused; with a prefill run: the unfused launches) and a padded decode
    batch, successive batches on the backend's one sync buffer. (The "side" design runs on CUDA only:
    test_lora_designs_gpu.py.)"""
    pool = loaded_pool(small_layout(), torch.bfloat16, device, seed=21)
    backend = TritonLoraBackend(pool, max_tokens=128, max_seqs=8, design="fused")
    compare_backends(pool, indptr_of([1] * 7), [3, 0, -1, 1, 2, 4, 0], seed=3, tri_backend=backend)
    compare_backends(pool, indptr_of(MIXED_LENGTHS), MIXED_SLOTS, seed=4, tri_backend=backend)
    compare_backends(pool, indptr_of([1] * 5), [3, 0, -1, 2, 1], seed=5, tri_backend=backend, pad_to=8)
    assert not backend._sync.any()


@pytest.mark.parametrize("lora_dtype", ["fp8", "int8"])
def test_fused_design_on_8bit_pools(device, lora_dtype, monkeypatch):
    monkeypatch.setenv("LORAPIPE_LORA_DESIGN", "fused")
    pool = fp8_pool(
        small_layout(max_rank=80, num_layers=1), [65, 3, 80, 1], device, seed=6, lora_dtype=lora_dtype
    )
    check_backend(pool, indptr_of([1, 1, 2, 1, 1]), [2, 0, -1, 1, 3], seed=7, max_seqs=8)


def test_unknown_design_is_refused(device):
    pool = loaded_pool(small_layout(), torch.float32, device, seed=1)
    with pytest.raises(ValueError, match="unknown LoRA design 'both'"):
        TritonLoraBackend(pool, max_tokens=8, design="both")
