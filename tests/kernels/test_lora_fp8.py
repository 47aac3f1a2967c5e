"""The 8-bit adapter pools (`--lora-dtype fp8`: e4m3, `int8`) with a scale per slice of each rank row, and
the shrink, expand and fused expand + activation kernels reading them, against a float64 computation of
the dequantized rows (ranks 1, odd, 16, above 64; rows of several adapters interleaved out of order; NaN
in every stale row and every free row, scales included), and the quantization against its definition."""

from __future__ import annotations

import argparse

import pytest
import torch

from kernels.fp8_quant import FP8, FP8_MAX
from kernels.lora_quant import NUM_SCALES, quantize_rows_ref, segments
from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout
from runtime.common.packed import PackedAdapter
from runtime.serve_args import add_serve_arguments
from stages.worker.lora.pool import LORA_DTYPES, LoraPool, pool_geometry, row_bytes
from stages.worker.lora.triton_backend import TritonLoraBackend
from tests.kernels.conftest import TOL, indptr_of, rel_err, small_layout


def _runs(gen: torch.Generator, total: int, ranks: list[int]) -> list[list[tuple[int, int]]]:
    """Each adapter's rows as runs of 1-3 rows at random free places, in descending order."""
    free = torch.randperm(total, generator=gen).tolist()
    out = []
    for r in ranks:
        rows, runs = sorted(free[:r], reverse=True), []
        free = free[r:]
        for row in rows:
            if runs and runs[-1][0] == row + 1 and runs[-1][1] < 3:
                runs[-1] = (row, runs[-1][1] + 1)
            else:
                runs.append((row, 1))
        out.append(runs)
    return out


def fp8_pool(layout: LoraLayout, ranks_of: list[int], device, seed: int, lora_dtype: str = "fp8") -> LoraPool:
    """An 8-bit pool of bf16 adapters of `ranks_of` (id i: rank ranks_of[i]; one more id stays empty),
    module ranks below the adapter's in some layers, rows past a module's rank NaN, 5 rows never
    written (NaN, their scales too)."""
    gen = torch.Generator().manual_seed(seed)
    pool = LoraPool(layout, sum(ranks_of) + 5, len(ranks_of) + 1, torch.bfloat16, device, lora_dtype)
    if pool.mem.dtype == FP8:
        pool.mem.fill_(float("nan"))
    else:  # int8 has no NaN: stale rows are large values instead (their scales are NaN)
        pool.mem.fill_(-128)
    pool.scales.fill_(float("nan"))
    for i, (rank, runs) in enumerate(zip(ranks_of, _runs(gen, pool.total_rows, ranks_of), strict=True)):
        L = layout.num_layers
        # rows of different magnitudes (each rank row its own): the per-row scales must follow them
        mag = torch.rand((L, rank, 1), generator=gen) * 4 + 0.05
        block = torch.randn((L, rank, layout.row_elems), generator=gen) * mag
        ranks = torch.randint(1, rank + 1, (L, NUM_SLICES), generator=gen, dtype=torch.int32)
        ranks[:, 0] = rank
        ranks[0, 3] = 0  # one module not targeted in one layer
        for layer in range(L):
            for sid, module in enumerate(TARGET_MODULES):
                g, j = layout.module_slot(module)
                r = int(ranks[layer, sid])
                a0, b0 = g.a_offset + j * g.in_stride, g.b_offset + g.out_offsets[j]
                block[layer, r:, a0 : a0 + g.in_dim] = float("nan")
                block[layer, r:, b0 : b0 + g.out_dims[j]] = float("nan")
        scalings = torch.rand((L, NUM_SLICES), generator=gen) + 0.5
        pool.load(i, PackedAdapter(f"a{i}", block.to(torch.bfloat16), ranks, scalings), runs)
    return pool


def expected_delta(pool: LoraPool, x, layer, g, indptr, seg_slots) -> torch.Tensor:
    """float64 delta [T, out_total]: scaling * x @ (q_A * s_A)^T @ (q_B * s_B) per token's adapter."""
    segs = segments(pool.layout)
    mem, scales = pool.mem[layer].cpu().double(), pool.scales[layer].cpu().double()
    out = torch.zeros((x.shape[0], g.out_total), dtype=torch.float64)
    for i, lora_id in enumerate(seg_slots):
        lo, hi = indptr[i], indptr[i + 1]
        if lora_id < 0 or hi == lo:
            continue
        rows = pool.host_rows[lora_id].long()
        for j in range(g.num_slices):
            sid = g.first_slice + j
            r = int(pool.host_ranks[lora_id, layer, sid])
            if r == 0:
                continue
            (a_off, a_n), (b_off, b_n) = segs[sid], segs[NUM_SLICES + sid]
            a = mem[rows[:r], a_off : a_off + a_n] * scales[rows[:r], sid, None]  # [r, in]
            b = mem[rows[:r], b_off : b_off + b_n] * scales[rows[:r], NUM_SLICES + sid, None]  # [r, out]
            scaling = float(pool.host_scalings[lora_id, layer, sid])
            o = g.out_offsets[j]
            out[lo:hi, o : o + b_n] = scaling * (x[lo:hi].double() @ a.t() @ b)
    return out


def check_backend(pool: LoraPool, indptr, seg_slots, seed: int, max_seqs: int) -> None:
    """Every group of every layer through `apply`, and the gate_up group through `apply_act` (fused
    with the activation where the batch has more tokens than `max_seqs`), against float64."""
    gen = torch.Generator().manual_seed(seed)
    backend = TritonLoraBackend(pool, max_tokens=128, max_seqs=max_seqs)
    backend.prepare(indptr, seg_slots)
    T, dev = indptr[-1], pool.device
    for layer in range(pool.layout.num_layers):
        for g in pool.layout.groups:
            x = torch.randn((T, g.in_dim), generator=gen).to(torch.bfloat16)
            out0 = torch.randn((T, g.out_total), generator=gen).to(torch.bfloat16)
            want = expected_delta(pool, x, layer, g, indptr, seg_slots)
            got = out0.clone().to(dev)
            backend.apply(x.to(dev), got, layer, g)
            got = got.cpu()
            assert torch.isfinite(got).all(), (layer, g.name)
            err = rel_err(got.double() - out0.double(), want)
            assert err < 2 * TOL[torch.bfloat16], (layer, g.name, err)
            if g.name == "gate_up":
                act = backend.apply_act(x.to(dev), out0.clone().to(dev), layer, g, _silu_mul).cpu()
                inter = g.out_total // 2
                full = out0.double() + want
                ref = torch.nn.functional.silu(full[:, :inter]) * full[:, inter:]
                assert rel_err(act, ref) < 3 * TOL[torch.bfloat16], (layer, "act")


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


# ragged segments, base-only tokens, adjacent runs of one adapter, decode-like one-token runs
LENGTHS = [3, 17, 1, 40, 1, 1, 2, 9, 1]  # rows 32-47 one adapter: a fused block
SLOTS = [0, -1, 2, 1, 3, 0, -1, 2, 4]


@pytest.mark.parametrize("lora_dtype", ["fp8", "int8"])
def test_fp8_kernels_mixed_ranks(device, lora_dtype):
    """Ranks 1, 7 (odd), 16 and 24 in one batch, prefill-sized (fused activation) and decode-sized."""
    pool = fp8_pool(small_layout(max_rank=24), [1, 7, 24, 16], device, seed=3, lora_dtype=lora_dtype)
    check_backend(pool, indptr_of(LENGTHS), SLOTS, seed=1, max_seqs=4)
    check_backend(pool, indptr_of([1] * 6), [3, 0, -1, 1, 2, 4], seed=2, max_seqs=8)


@pytest.mark.parametrize("lora_dtype", ["fp8", "int8"])
def test_fp8_kernels_ranks_above_64(device, lora_dtype):
    pool = fp8_pool(
        small_layout(max_rank=80, num_layers=1), [65, 3, 80], device, seed=4, lora_dtype=lora_dtype
    )
    check_backend(pool, indptr_of([4, 2, 1, 36]), [2, 0, -1, 1], seed=5, max_seqs=2)


def test_quantized_rows_follow_their_definition():
    """Each segment of each rank row: scale amax / 448, q = x / scale rounded to e4m3 (so its largest
    magnitude is 448), dequantized within e4m3's rounding of the bf16 block; padding untouched."""
    layout = small_layout(max_rank=8)
    gen = torch.Generator().manual_seed(9)
    block = (torch.randn((2, 5, layout.row_elems), generator=gen) * 3).to(torch.bfloat16)
    block[1, 2] = 0.0  # an all-zero rank row: scale 1, zeros
    q, scales = quantize_rows_ref(block, segments(layout))
    pool = LoraPool(layout, 12, 2, torch.bfloat16, torch.device("cpu"), "fp8")
    ranks = torch.full((2, NUM_SLICES), 5, dtype=torch.int32)
    pool.load(1, PackedAdapter("a", block, ranks, torch.ones(2, NUM_SLICES)), [(9, 2), (0, 3)])
    rows = [9, 10, 0, 1, 2]
    assert pool.mem.dtype == FP8 and pool.scales.shape == (2, 12, NUM_SCALES)
    assert torch.equal(pool.scales[:, rows], scales)
    for j, (off, n) in enumerate(segments(layout)):
        x = block[..., off : off + n].float()
        top = x.abs().amax(-1)
        assert torch.equal(scales[..., j], torch.where(top > 0, top / FP8_MAX, torch.ones_like(top)))
        got = pool.mem[:, rows, off : off + n]
        assert torch.equal(got.view(torch.uint8), q[..., off : off + n].view(torch.uint8))
        assert torch.equal(got.float(), (x / scales[..., j, None]).to(FP8).float())
        deq = got.float() * pool.scales[:, rows, j, None]
        assert ((deq - x).abs() <= x.abs() / 16 + scales[..., j, None] * 2**-9).all()  # half an ulp
    assert (pool.scales[1, 0, :] == 1.0).all() and (pool.mem[1, 0].float() == 0).all()


def test_int8_rows_follow_their_definition():
    """int8: scale amax / 127, q = x / scale rounded to nearest (the largest magnitude 127), dequantized
    within half a step; the Triton kernel (on the GPU, tests/kernels/test_lora_fp8_gpu.py) agrees."""
    layout = small_layout(max_rank=8)
    gen = torch.Generator().manual_seed(10)
    block = (torch.randn((2, 4, layout.row_elems), generator=gen) * 5).to(torch.bfloat16)
    pool = LoraPool(layout, 6, 2, torch.bfloat16, torch.device("cpu"), "int8")
    ranks = torch.full((2, NUM_SLICES), 4, dtype=torch.int32)
    pool.load(0, PackedAdapter("a", block, ranks, torch.ones(2, NUM_SLICES)), [(2, 4)])
    assert pool.mem.dtype == torch.int8
    for j, (off, n) in enumerate(segments(layout)):
        x = block[..., off : off + n].float()
        s = pool.scales[:, 2:6, j, None]
        assert torch.equal(s[..., 0], x.abs().amax(-1) / 127)
        q = pool.mem[:, 2:6, off : off + n].float()
        assert torch.equal(q.abs().amax(-1), torch.full_like(q[..., 0], 127.0))
        assert ((q * s - x).abs() <= s / 2 * (1 + 1e-5)).all()


def test_fp8_pool_geometry():
    """An e4m3 row costs one byte an element plus its fp32 scales: about twice the rows of bf16."""
    layout = LoraLayout.build(
        num_layers=16, hidden=2048, q_out=2048, kv_out=512, intermediate=8192, max_rank=64
    )
    bf16, fp8 = row_bytes(layout, torch.bfloat16), row_bytes(layout, torch.bfloat16, "fp8")
    assert row_bytes(layout, torch.bfloat16, "int8") == fp8
    assert fp8 == 16 * (layout.row_elems + 4 * NUM_SCALES) and 1.9 < bf16 / fp8 < 2.0
    nbytes = 1 << 30
    assert pool_geometry(layout, torch.bfloat16, nbytes, "fp8")[0] == nbytes // fp8
    pool = LoraPool(layout, 70, 4, torch.bfloat16, torch.device("cpu"), "fp8")
    assert pool.row_nbytes == fp8


def test_serve_flag_choices_match_the_pool():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    action = next(a for a in p._actions if "--lora-dtype" in a.option_strings)
    assert tuple(action.choices) == LORA_DTYPES and action.default == "auto"


def test_scales_are_required_exactly_for_e4m3_rows(device):
    from kernels.batch_info import BatchInfoBuilder
    from kernels.lora_shrink import lora_shrink

    pool = fp8_pool(small_layout(max_rank=8), [4], device, seed=6)
    g = pool.layout.group("qkv")
    a = LoraLayout.a_rows(pool.mem[0], g)
    ranks = pool.ranks[:, 0, : g.num_slices]
    info = BatchInfoBuilder(16, device).build([0, 2], [0], 4)
    x = torch.randn((2, g.in_dim), device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="scales are required"):
        lora_shrink(x, a, ranks, pool.rows, info)
    bad = pool.scales[0][:, :2]  # two columns for a three-slice group
    with pytest.raises(ValueError, match="scales must be float32"):
        lora_shrink(x, a, ranks, pool.rows, info, a_scales=bad)
