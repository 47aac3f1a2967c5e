"""TritonLoraBackend against TorchLoraBackend on LoraSlots loaded with random adapters (all four groups,
stale NaN rows past every rank), on the slots themselves (identity row table) and on an external
scattered pool with its row table, the tile planner, and (GPU only) a mixed batch with sync debug on."""

from __future__ import annotations

import pytest
import torch

from kernels.batch_info import BatchInfoBuilder, plan_runs, plan_tiles
from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout
from runtime.common.packed import PackedAdapter
from stages.worker.lora.factory import make_backend
from stages.worker.lora.slots import LoraSlots
from stages.worker.lora.triton_backend import TritonLoraBackend
from tests.kernels.conftest import (
    MIXED_LENGTHS,
    MIXED_SLOTS,
    TOL,
    indptr_of,
    owned_rows,
    rel_err,
    scatter_to_pool,
    small_layout,
)

ADAPTER_RANKS = [1, 7, 24, 16]  # slot i holds a rank-ADAPTER_RANKS[i] adapter; slot 4 stays empty


def loaded_slots(layout: LoraLayout, dtype: torch.dtype, device: torch.device, seed: int) -> LoraSlots:
    gen = torch.Generator().manual_seed(seed)
    slots = LoraSlots(layout, num_slots=5, dtype=dtype, device=device)
    slots.mem.fill_(float("nan"))  # never-written rows: stale garbage
    for slot, rank in enumerate(ADAPTER_RANKS):
        block = torch.randn((layout.num_layers, rank, layout.row_elems), generator=gen)  # [L, r, row]
        ranks = torch.randint(0, rank + 1, (layout.num_layers, NUM_SLICES), generator=gen, dtype=torch.int32)
        ranks[:, 0] = rank
        ranks[0, 3] = 0  # one module not targeted in one layer
        for layer in range(layout.num_layers):  # rows past a module's own rank are stale too
            for sid, module in enumerate(TARGET_MODULES):
                g, i = layout.module_slot(module)
                r = int(ranks[layer, sid])
                block[layer, r:, g.a_offset + i * g.in_stride : g.a_offset + i * g.in_stride + g.in_dim] = (
                    float("nan")
                )
                block[
                    layer, r:, g.b_offset + g.out_offsets[i] : g.b_offset + g.out_offsets[i] + g.out_dims[i]
                ] = float("nan")
        scalings = torch.rand((layout.num_layers, NUM_SLICES), generator=gen) + 0.5
        slots.load(slot, PackedAdapter(f"a{slot}", block.to(dtype), ranks, scalings))
    return slots


def compare_backends(
    slots: LoraSlots, indptr: list[int], seg_slots: list[int], seed: int, tri_backend=None, pad_to=None
) -> None:
    """`tri_backend` (default: one on the slots themselves) against the torch backend on `slots`."""
    gen = torch.Generator().manual_seed(seed)
    layout = slots.layout
    ref_backend = make_backend("torch", slots, max_tokens=128)
    tri_backend = tri_backend or make_backend("triton", slots, max_tokens=128)
    assert tri_backend.name == "triton"
    T = indptr[-1]
    no_adapter = torch.ones(T, dtype=torch.bool)
    for i, s in enumerate(seg_slots):
        if s >= 0:
            no_adapter[indptr[i] : indptr[i + 1]] = False
    ref_backend.prepare(indptr, seg_slots)
    tri_backend.prepare(indptr, seg_slots, pad_to=pad_to)
    T = pad_to or T
    no_adapter = torch.cat([no_adapter, torch.ones(T - no_adapter.shape[0], dtype=torch.bool)])
    for layer in range(layout.num_layers):
        for g in layout.groups:
            x = torch.randn((T, g.in_dim), generator=gen).to(slots.dtype).to(slots.device)
            out0 = torch.randn((T, g.out_total), generator=gen).to(slots.dtype).to(slots.device)
            want, got = out0.clone(), out0.clone()
            ref_backend.apply(x[: indptr[-1]], want[: indptr[-1]], layer, g)
            tri_backend.apply(x, got, layer, g)
            assert torch.isfinite(got).all(), (layer, g.name)
            assert torch.equal(got[no_adapter.to(got.device)], out0[no_adapter.to(got.device)])
            err = rel_err((got - out0).cpu(), (want - out0).cpu())
            assert err < 2 * TOL[slots.dtype], (layer, g.name, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_matches_torch_mixed_batch(device, dtype):
    slots = loaded_slots(small_layout(), dtype, device, seed=7)
    compare_backends(slots, indptr_of(MIXED_LENGTHS), MIXED_SLOTS, seed=1)


def test_backend_successive_batches(device):
    """Decode (one token per adapter) after prefill: the fixed device buffers are rewritten each time."""
    slots = loaded_slots(small_layout(), torch.bfloat16, device, seed=8)
    compare_backends(slots, indptr_of(MIXED_LENGTHS), MIXED_SLOTS, seed=2)
    compare_backends(slots, indptr_of([1] * 7), [3, 0, -1, 1, 2, 4, 0], seed=3)
    compare_backends(slots, indptr_of([2, 3]), [-1, -1], seed=4)  # base only: nothing launched


def pool_backend(slots: LoraSlots, seed: int, width: int) -> TritonLoraBackend:
    """A backend on a scattered copy of the slots' adapters (rows out of order, interleaved, NaN rows in
    between), with a row table `width` wide; slot memory is then NaN so that reading it shows."""
    gen = torch.Generator().manual_seed(seed)
    owned = owned_rows(slots.host_ranks)
    pool, rows = scatter_to_pool(gen, slots.mem.cpu(), owned, width)  # [L, P, row], [S, width]
    return TritonLoraBackend(slots, max_tokens=128, pool=pool.to(slots.device), rows=rows.to(slots.device))


def test_backend_on_external_pool(device):
    dtype = torch.bfloat16
    slots = loaded_slots(small_layout(), dtype, device, seed=10)
    backend = pool_backend(slots, seed=11, width=slots.layout.max_rank + 5)
    reference = LoraSlots(slots.layout, slots.num_slots, dtype, device)  # the same adapters, in slots
    reference.mem.copy_(slots.mem)
    for t in ("ranks", "scalings", "host_ranks", "host_scalings"):
        getattr(reference, t).copy_(getattr(slots, t))
    slots.mem.fill_(float("nan"))  # the pool backend must read nothing of slot memory
    compare_backends(reference, indptr_of(MIXED_LENGTHS), MIXED_SLOTS, seed=1, tri_backend=backend)
    # a fixed-shape (padded) decode batch after it: the same views and table
    compare_backends(reference, indptr_of([1] * 5), [3, 0, -1, 2, 1], seed=2, tri_backend=backend, pad_to=8)


def test_backend_rows_contract(device):
    slots = loaded_slots(small_layout(), torch.float32, device, seed=12)
    layout, S = slots.layout, slots.num_slots
    identity = make_backend("triton", slots, max_tokens=16).rows
    assert identity.dtype == torch.int32 and tuple(identity.shape) == (S, layout.max_rank)
    L, R = layout.num_layers, layout.max_rank
    assert identity[3, 5].item() == 3 * L * R + 5  # slot 3's rank row 5, relative to mem[0, layer]
    pool = torch.zeros((L, 40, layout.row_elems), dtype=slots.dtype, device=device)
    rows = torch.zeros((S, R), dtype=torch.int32, device=device)
    assert TritonLoraBackend(slots, 16, pool=pool, rows=rows).rows is rows  # externally owned, not copied
    TritonLoraBackend(slots, 16, rows=rows)  # a table over the slot memory's rows
    bad = [
        dict(pool=pool),  # a pool without its table
        dict(pool=pool, rows=rows.long()),
        dict(pool=pool, rows=rows[:, : R - 1]),  # narrower than max_lora_rank
        dict(pool=pool, rows=rows[: S - 1]),  # one row per adapter id
        dict(pool=pool[:, :, :-1], rows=rows),
        dict(pool=pool[:1], rows=rows),
        dict(pool=pool.double(), rows=rows),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            TritonLoraBackend(slots, 16, **kw)


def test_planner_merges_and_splits():
    runs = plan_runs([0, 2, 2, 5, 9, 10, 30], [3, 1, 3, 3, -1, 0])
    # the empty slot-1 segment is dropped, so slot 3's three segments merge into one run
    assert [r.tolist() for r in runs] == [[0, 10], [9, 30], [3, 0]]
    tiles = plan_tiles(runs, 16)
    assert tiles[:, :3].tolist() == [[0, 9, 3], [10, 26, 0], [26, 30, 0]]
    info = BatchInfoBuilder(64, "cpu").build([0, 2, 2, 5, 9, 10, 30], [3, 1, 3, 3, -1, 0], 5)
    assert (info.num_tiles, info.max_len, info.block_m, info.block_rank) == (3, 20, 16, 16)
    assert info.meta[:4].tolist() == [[3, 30, 20, 16], [0, 9, 3, 0], [10, 26, 0, 0], [26, 30, 0, 0]]
    assert BatchInfoBuilder(1024, "cpu").build([0, 600, 700], [1, 2], 64).block_m == 64  # prefill-sized
    with pytest.raises(ValueError, match="max_tokens"):
        BatchInfoBuilder(8, "cpu").build([0, 9], [0], 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_backend_no_sync_on_gpu():
    device = torch.device("cuda")
    slots = loaded_slots(small_layout(), torch.bfloat16, device, seed=9)
    backend = make_backend("triton", slots, max_tokens=128)
    indptr, seg_slots = indptr_of(MIXED_LENGTHS), MIXED_SLOTS
    xs = {
        g.name: torch.randn((indptr[-1], g.in_dim), device=device, dtype=slots.dtype)
        for g in slots.layout.groups
    }
    outs = {
        g.name: torch.zeros((indptr[-1], g.out_total), device=device, dtype=slots.dtype)
        for g in slots.layout.groups
    }
    backend.prepare(indptr, seg_slots)  # warm-up: compiles the kernels
    for g in slots.layout.groups:
        backend.apply(xs[g.name], outs[g.name].clone(), 0, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):  # laps the pinned ring
            backend.prepare(indptr, seg_slots)
            for layer in range(slots.layout.num_layers):
                for g in slots.layout.groups:
                    backend.apply(xs[g.name], outs[g.name], layer, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for out in outs.values():
        assert torch.isfinite(out).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rank", [16, 64])
def test_backend_llama_shapes_on_gpu(rank):
    """Real Llama-3-8B widths (vectorised loads, wide tiles) on a decode and a prefill batch."""
    layout = LoraLayout.build(
        num_layers=1, hidden=4096, q_out=4096, kv_out=1024, intermediate=14336, max_rank=64
    )
    slots = LoraSlots(layout, num_slots=8, dtype=torch.bfloat16, device=torch.device("cuda"))
    gen = torch.Generator().manual_seed(rank)
    for slot in range(8):
        block = (torch.randn((1, rank, layout.row_elems), generator=gen) * 0.05).to(torch.bfloat16)
        ranks = torch.full((1, NUM_SLICES), rank, dtype=torch.int32)
        slots.load(slot, PackedAdapter(f"a{slot}", block, ranks, torch.full((1, NUM_SLICES), 2.0)))
    compare_backends_big(slots, indptr_of([1] * 48), [i % 8 for i in range(48)])
    compare_backends_big(slots, indptr_of([300, 1, 700, 24]), [2, -1, 5, 1])


def compare_backends_big(slots: LoraSlots, indptr: list[int], seg_slots: list[int]) -> None:
    ref_backend = make_backend("torch", slots, max_tokens=2048)
    tri_backend = make_backend("triton", slots, max_tokens=2048)
    ref_backend.prepare(indptr, seg_slots)
    tri_backend.prepare(indptr, seg_slots)
    for g in slots.layout.groups:
        x = torch.randn((indptr[-1], g.in_dim), device="cuda", dtype=slots.dtype)
        out0 = torch.randn((indptr[-1], g.out_total), device="cuda", dtype=slots.dtype)
        want, got = out0.clone(), out0.clone()
        ref_backend.apply(x, want, 0, g)
        tri_backend.apply(x, got, 0, g)
        assert rel_err(got - out0, want - out0) < 2 * TOL[slots.dtype], g.name
