"""lora_shrink against a float64 torch computation of each adapter's own weights: ragged segments, ranks
per adapter (1, odd, 0, above 64), base-only tokens, widths not multiples of 16, NaN in every stale row
past a rank, NaN-poisoned output, adapter rows read through the row table from slot memory (identity
table) or from a scattered pool (rows out of order, interleaved with other adapters' and NaN rows)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import device_info
from kernels.batch_info import BatchInfoBuilder, block_rank_for
from kernels.lora_shrink import (
    SHRINK_STAGES,
    ShrinkConfig,
    fit_k_step,
    lora_shrink,
    lora_shrink_ref,
    shrink_config,
)
from runtime.common.lora_layout import LoraLayout
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


def expected_shrink(x, a, ranks, indptr, seg_slots, block_rank):
    """float64 v [T, N, block_rank] and the mask of entries below each rank (the kernel must write)."""
    T, num_slices = x.shape[0], a.shape[2]
    v = torch.zeros((T, num_slices, block_rank), dtype=torch.float64)
    written = torch.zeros((T, num_slices, block_rank), dtype=torch.bool)
    for i, slot in enumerate(seg_slots):
        lo, hi = indptr[i], indptr[i + 1]
        if slot < 0 or hi == lo:
            continue
        for s in range(num_slices):
            r = int(ranks[slot, s])
            v[lo:hi, s, :r] = x[lo:hi].double() @ a[slot, :r, s].double().t()
            written[lo:hi, s, :r] = True
    return v, written


def run_case(device, dtype, group_name, lengths, seg_slots, block_m, config, seed, pool="slots", tables=None):
    """`pool`: "slots" (slot memory, identity row table) or "scattered"; `tables`: (max_rank, first,
    choices) of `random_slot_tables` (default: ranks up to 24)."""
    gen = torch.Generator().manual_seed(seed)
    max_rank, *rank_args = tables or (24,)
    layout = small_layout(max_rank=max_rank)
    g = layout.group(group_name)
    mem, ranks_all, _ = random_slot_tables(gen, layout, 6 if tables else 5, dtype, (4,), *rank_args)
    layer = seed % layout.num_layers
    a_cpu = LoraLayout.a_view(mem, layer, g)  # [S, R, N, K] strided: each adapter's own A
    ranks_cpu = ranks_all[:, layer, g.first_slice : g.first_slice + g.num_slices]
    indptr = indptr_of(lengths)
    x_cpu = torch.randn((indptr[-1], g.in_dim), generator=gen).to(dtype)

    used = [s for s in seg_slots if s >= 0]
    info = BatchInfoBuilder(128, device).build(indptr, seg_slots, int(ranks_all[used].max()), block_m=block_m)
    assert info.block_rank == block_rank_for(int(ranks_all[used].max()))
    base, rows = pool_operands(gen, mem, ranks_all, layout, pool, device)
    a = LoraLayout.a_rows(layer_rows(base, layer, pool), g)  # [P, N, K] strided
    ranks = ranks_all.to(device)[:, layer, g.first_slice : g.first_slice + g.num_slices]  # strided view
    sizes = (x_cpu.element_size(), a.element_size())
    config = config or shrink_config(info, g.in_dim, g.num_slices, operand_bytes=sizes)
    shape = (config.parts, indptr[-1], g.num_slices, info.block_rank)  # the partials, or their sum
    out = torch.full(shape, float("nan"), dtype=torch.float32, device=device)  # poisoned: untouched stays NaN
    # A reducing split's partials poisoned too: one summed before its split stored it would make v NaN.
    partials = torch.full((config.split_k * out[0].numel(),), float("nan"), device=device)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    x = x_cpu.to(device)
    scratch = dict(partials=partials, counters=counters, config=config)
    v = lora_shrink(x, a, ranks, rows, info, out=out, **scratch).cpu()
    assert (counters == 0).all(), "a launch must leave its split counters at zero for the next"
    again = lora_shrink(x, a, ranks, rows, info, **scratch).cpu()
    written_any = ~torch.isnan(v)
    assert torch.equal(again[written_any], v[written_any]), "the split-K sum must not depend on the launch"

    ref, written = expected_shrink(x_cpu, a_cpu, ranks_cpu, indptr, seg_slots, info.block_rank)
    adapter_rows = written.any(dim=(1, 2))
    zero_pad = torch.zeros_like(written)  # the expand reads v in 16-column groups
    for t, s in written.any(dim=2).nonzero().tolist():
        r = int(written[t, s].sum())
        zero_pad[t, s, r : (r + 15) // 16 * 16] = True
    assert torch.isfinite(v[:, written]).all(), "an entry the kernel must write is missing or NaN"
    rest = v[:, ~written]
    assert ((rest == 0) | torch.isnan(rest)).all(), "the kernel wrote nonzeros outside the real ranks"
    assert torch.isnan(v[:, ~adapter_rows]).all(), "the kernel wrote rows of base-only tokens"
    assert (v[:, zero_pad] == 0).all(), "columns past a rank, up to a multiple of 16, must hold zeros"
    err = rel_err(v.sum(0)[written], ref[written])
    assert err < TOL[dtype], err
    # The plain torch reference computes the same function.
    plain = lora_shrink_ref(x_cpu.to(device), a, ranks, rows, info).cpu()
    assert rel_err(plain[written], ref[written]) < TOL[dtype]
    assert (plain[~written] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_name", ["qkv", "gate_up", "down"])
def test_shrink_mixed_batch_default_config(device, dtype, group_name):
    run_case(device, dtype, group_name, MIXED_LENGTHS, MIXED_SLOTS, None, None, seed=1)


@pytest.mark.parametrize("group_name", ["qkv", "down"])
def test_shrink_scattered_pool(device, group_name):
    """Every adapter's rows scattered over a shared pool, other adapters' and NaN rows in between."""
    run_case(device, torch.bfloat16, group_name, MIXED_LENGTHS, MIXED_SLOTS, None, None, 4, "scattered")


# Ranks above 64 (block rank 128): 80, 100, 128 and small or odd ones mixed; a table as wide as the largest
# rank (128) or narrower than the rank tile (80: columns 80..127 of the tile have no table entry).
LARGE_TABLES = [(128, LARGE_FIRST, LARGE_CHOICES), (80, (80, 1, 65, 33, 0, 7), (1, 7, 80, 0, 65, 33))]
LARGE_SLOTS = [2, -1, 0, 4, 1, 5, 3, -1, 2, 0]
LARGE_LENGTHS = [3, 2, 5, 1, 4, 2, 17, 1, 3, 1]


@pytest.mark.parametrize("tables", LARGE_TABLES, ids=["width128", "width80"])
@pytest.mark.parametrize("pool", ["slots", "scattered"])
def test_shrink_large_ranks(device, tables, pool):
    run_case(device, torch.bfloat16, "qkv", LARGE_LENGTHS, LARGE_SLOTS, None, None, 5, pool, tables)
    config = ShrinkConfig(block_n=64, block_k=32, split_k=2)  # rank chunks narrower than the 128 tile
    run_case(device, torch.float32, "o", LARGE_LENGTHS, LARGE_SLOTS, 16, config, 6, pool, tables)
    config = ShrinkConfig(block_n=64, block_k=32, split_k=4, reduce=True)  # the shrink sums, rank tile 128
    run_case(device, torch.bfloat16, "down", LARGE_LENGTHS, LARGE_SLOTS, 16, config, 7, pool, tables)


@pytest.mark.parametrize("pool", ["slots", "scattered"])
@pytest.mark.parametrize(
    "block_m,config",
    [
        (16, ShrinkConfig(block_n=16, block_k=16, split_k=1)),  # rank chunks narrower than block_rank
        (16, ShrinkConfig(block_n=32, block_k=16, split_k=3)),  # uneven split-K, last split past K
        (32, ShrinkConfig(block_n=64, block_k=32, split_k=2, num_warps=2)),  # two slices per program
        (64, ShrinkConfig(block_n=128, block_k=16, split_k=1, num_stages=2)),  # all slices in one block
        (16, ShrinkConfig(block_n=32, block_k=16, split_k=3, reduce=True)),  # summed in the kernel, uneven
        (16, ShrinkConfig(block_n=16, block_k=16, split_k=8, reduce=True)),  # 8 partials, narrow blocks
        (32, ShrinkConfig(block_n=64, block_k=32, split_k=1, reduce=True)),  # nothing to sum
    ],
)
def test_shrink_block_shapes(device, block_m, config, pool):
    run_case(device, torch.bfloat16, "qkv", MIXED_LENGTHS, MIXED_SLOTS, block_m, config, block_m, pool)


def test_shrink_decode_distinct_adapters(device):
    """Segments of one token, each its own slot or none (decode)."""
    lengths = [1] * 9
    slots = [0, 1, -1, 2, 3, 4, 0, -1, 2]
    run_case(device, torch.bfloat16, "qkv", lengths, slots, 16, ShrinkConfig(16, 16, 2), 3, "scattered")
    run_case(
        device,
        torch.bfloat16,
        "qkv",
        lengths,
        slots,
        16,
        ShrinkConfig(16, 16, 4, reduce=True),
        3,
        "scattered",
    )


@pytest.mark.parametrize("split", [2, 3, 8])
def test_shrink_sum_is_the_partials_summed_in_split_order(device, split):
    """A reducing shrink writes exactly what the expand would sum from the partials (fp32, split order),
    so both paths round alike."""
    layout = small_layout(max_rank=24)
    g = layout.group("down")
    gen = torch.Generator().manual_seed(split)
    mem, ranks_all, _ = random_slot_tables(gen, layout, 5, torch.bfloat16, (4,))
    base, rows = pool_operands(gen, mem, ranks_all, layout, "scattered", device)
    a = LoraLayout.a_rows(layer_rows(base, 0, "scattered"), g)
    ranks = ranks_all.to(device)[:, 0, g.first_slice : g.first_slice + 1]
    info = BatchInfoBuilder(128, device).build(indptr_of(MIXED_LENGTHS), MIXED_SLOTS, 24)
    x = torch.randn((info.num_tokens, g.in_dim), generator=gen).to(torch.bfloat16).to(device)
    shape = (info.num_tokens, 1, info.block_rank)  # entries neither writes stay zero in both
    parts, summed = torch.zeros((split, *shape), device=device), torch.zeros((1, *shape), device=device)
    lora_shrink(x, a, ranks, rows, info, out=parts, config=ShrinkConfig(16, 16, split))
    lora_shrink(x, a, ranks, rows, info, out=summed, config=ShrinkConfig(16, 16, split, reduce=True))
    parts, summed = parts.cpu(), summed.cpu()
    assert parts.shape[0] == split and summed.shape[0] == 1
    want = parts[0].clone()
    for p in range(1, split):
        want += parts[p]
    rows_used = torch.zeros(info.num_tokens, dtype=torch.bool)
    for (lo, hi), slot in zip(itertools.pairwise(indptr_of(MIXED_LENGTHS)), MIXED_SLOTS, strict=True):
        rows_used[lo:hi] = slot >= 0
    assert torch.equal(summed[0][rows_used], want[rows_used])


def test_shrink_no_adapter_tokens_launches_nothing(device):
    layout = small_layout()
    g = layout.group("o")
    mem = torch.randn((2, layout.num_layers, layout.max_rank, layout.row_elems), device=device)
    ranks = torch.ones((2, 1), dtype=torch.int32, device=device)
    info = BatchInfoBuilder(16, device).build([0, 3, 5], [-1, -1], 0)
    assert info.num_tiles == 0
    out = torch.full((1, 5, 1, 16), float("nan"), device=device)
    lora_shrink(
        torch.randn(5, g.in_dim, device=device),
        LoraLayout.a_rows(LoraLayout.slot_rows(mem, 0), g),
        ranks,
        layout.slot_row_table(2, device),
        info,
        out=out,
        config=ShrinkConfig(16, 16, 1),
    )
    assert torch.isnan(out).all()


def test_shrink_rejects_bad_inputs(device):
    layout = small_layout()
    g = layout.group("qkv")
    mem = torch.randn((2, layout.num_layers, layout.max_rank, layout.row_elems), device=device)
    a = LoraLayout.a_rows(LoraLayout.slot_rows(mem, 0), g)
    ranks = torch.ones((2, 3), dtype=torch.int32, device=device)
    rows = layout.slot_row_table(2, device)
    info = BatchInfoBuilder(16, device).build([0, 4], [1], 1)
    x = torch.randn(4, g.in_dim, device=device)
    with pytest.raises(ValueError, match="K="):
        lora_shrink(torch.randn(4, g.in_dim + 1, device=device), a, ranks, rows, info)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, a, ranks.long(), rows, info)
    with pytest.raises(ValueError, match="dtype"):
        lora_shrink(x.half(), a, ranks, rows, info)
    with pytest.raises(ValueError, match="contiguous"):
        lora_shrink(torch.randn(g.in_dim, 4, device=device).t(), a, ranks, rows, info)
    with pytest.raises(ValueError, match="tokens"):
        lora_shrink(torch.randn(5, g.in_dim, device=device), a, ranks, rows, info)
    with pytest.raises(ValueError, match="out must be"):
        lora_shrink(
            x,
            a,
            ranks,
            rows,
            info,
            out=torch.empty(1, 4, 3, 8, device=device),
            config=ShrinkConfig(16, 16, 1),
        )
    with pytest.raises(ValueError, match="expected"):
        lora_shrink(x, LoraLayout.a_view(mem, 0, g), ranks, rows, info)  # slot-shaped A, no longer taken
    split = ShrinkConfig(16, 16, 2, reduce=True)
    with pytest.raises(ValueError, match="partials must be"):
        lora_shrink(x, a, ranks, rows, info, partials=torch.empty(10, device=device), config=split)
    with pytest.raises(ValueError, match="counters must be"):
        lora_shrink(x, a, ranks, rows, info, counters=torch.zeros(64, device=device), config=split)


def test_shrink_rejects_bad_row_tables(device):
    layout = small_layout()
    g = layout.group("o")
    a = LoraLayout.a_view(torch.randn((layout.num_layers, 50, layout.row_elems), device=device), 0, g)
    ranks = torch.ones((3, 1), dtype=torch.int32, device=device)
    rows = torch.zeros((3, 24), dtype=torch.int32, device=device)
    x = torch.randn(4, g.in_dim, device=device)
    info = BatchInfoBuilder(16, device).build([0, 4], [1], 24)  # rank tile 32
    lora_shrink(x, a, ranks, rows, info)  # a table 24 wide covers ranks up to 24 (tile 32)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, a, ranks, rows.long(), info)
    with pytest.raises(ValueError, match="rows must be"):
        lora_shrink(x, a, ranks, rows[:2], info)  # one entry per adapter id
    with pytest.raises(ValueError, match="rows must be"):
        lora_shrink(x, a, ranks, rows[0], info)
    with pytest.raises(ValueError, match="contiguous"):
        lora_shrink(x, a, ranks, torch.zeros((24, 3), dtype=torch.int32, device=device).t(), info)
    with pytest.raises(ValueError, match="covers ranks up to 16"):
        lora_shrink(x, a, ranks, rows[:, :16], info)  # the batch was planned for ranks above 16


@pytest.mark.parametrize("limit", [device_info.HOPPER_MAX_SHARED, 101376, 49152])
def test_k_step_is_the_largest_that_fits_shared_memory(monkeypatch, limit):
    """(The compiled kernels' own needs: tests/stages/worker/test_warmup_smem.py.) bf16 tiles, and bf16 x
    over an 8-bit pool, keep the tuned 128-wide K step and SHRINK_STAGES on Hopper; elsewhere the K
    step halves first, then stages drop, only as far as the pipelined tiles need to fit."""
    monkeypatch.setattr(device_info, "max_shared_memory", lambda _device: limit)
    cpu = torch.device("cpu")
    for bm, bn, (xb, ab) in itertools.product((16, 64), (16, 32, 64, 128), ((4, 4), (2, 2), (2, 1))):
        k, stages = fit_k_step(bm, bn, 128, (xb, ab), cpu)

        def need(k: int, s: int, bm=bm, bn=bn, xb=xb, ab=ab) -> int:
            return s * k * (bm * xb + bn * ab)

        assert need(k, stages) <= limit, (bm, bn, xb, ab)
        assert k == 128 or need(2 * k, stages) > limit  # the K step halved only while it did not fit
        assert stages == SHRINK_STAGES or (k == 16 and need(k, stages + 1) > limit)
        if limit == device_info.HOPPER_MAX_SHARED and xb == 2:
            assert (k, stages) == (128, SHRINK_STAGES), (bm, bn, ab)
