"""What the "fold" LoRA kernels share (`lora_fold_norm`, `lora_fold_rope`, `lora_fold_act`): each folds a
group's shrink into the kernel that makes the group's input and the expand into the kernel that next
reads its output, so a decode layer launches one LoRA kernel of its own (o's shrink). The operands of one
fold (`FoldExpand`, `FoldShrink`), and the device pieces: a token row's adapter id from the batch tiles,
and one row's delta over a column block.

A shrink folded into an RMSNorm (`lora_fold_norm`) multiplies A by w * h, the weighted row before its
normalisation, and stores the row's 1 / rms beside it (`FoldShrink.inv`); whoever reads that v scales it
by the row's factor (`FoldExpand.inv`): the same product, A x = (A (w * h)) / rms, computed without
waiting for the row's norm, which needs the whole row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora_parts import tile_of


@dataclass(frozen=True)
class FoldExpand:
    """An expand a fold kernel adds to its input: out[t, cols] += scaling * (inv[t] *) v[t] @ B."""

    v: torch.Tensor  # [P, T, slices, block_rank] fp32 partials, summed by the reader
    b: torch.Tensor  # [pool_rows, out_total] B^T rows of one layer (strided view, last dim contiguous)
    ranks: torch.Tensor  # [num_ids, slices] int32
    scalings: torch.Tensor  # [num_ids, slices] fp32
    b_scales: torch.Tensor | None = None  # [pool_rows, slices] fp32 of an 8-bit pool
    inv: torch.Tensor | None = None  # [T] fp32: v's row factor (a shrink folded into a norm), else None


@dataclass(frozen=True)
class FoldShrink:
    """A shrink a fold kernel computes from its output: v[p, t, s, :r] partial p of x[t] @ A_s^T."""

    a: torch.Tensor  # [pool_rows, slices, in_dim] A rows of one layer (strided view)
    ranks: torch.Tensor  # [num_ids, slices] int32
    v: torch.Tensor  # [P, T, slices, block_rank] fp32, written at adapter rows (whole 16-column groups)
    a_scales: torch.Tensor | None = None  # [pool_rows, slices] fp32 of an 8-bit pool
    inv: torch.Tensor | None = None  # [T] fp32 a norm writes: each row's 1 / rms (see the module doc)


def check_fold(t: torch.Tensor, w: torch.Tensor, v: torch.Tensor, ranks: torch.Tensor, info) -> None:
    """What every fold operand must be: rows [T, ...] matching the batch, v fp32 [P, T, n, block_rank]
    contiguous, w (A or B rows) with a contiguous last dim, all on the batch's device."""
    T = info.num_tokens
    if t.shape[0] != T or t.stride(-1) != 1:
        raise ValueError(f"rows {tuple(t.shape)} do not match the batch of {T} tokens (contiguous rows)")
    if v.dim() != 4 or v.shape[1] != T or v.shape[3] != info.block_rank or v.dtype != torch.float32:
        raise ValueError(f"v must be fp32 [P, {T}, n, {info.block_rank}], got {v.dtype} {tuple(v.shape)}")
    if not v.is_contiguous() or v.shape[2] != ranks.shape[1] or ranks.dtype != torch.int32:
        raise ValueError(f"v {tuple(v.shape)} and ranks {tuple(ranks.shape)} {ranks.dtype} do not match")
    if w.stride(-1) != 1:
        raise ValueError("adapter rows must be contiguous in their last dim")
    if not (t.device == w.device == v.device == ranks.device == info.meta.device):
        raise ValueError("fold operands and the batch metadata must be on one device")


# Narrowest tile search: the grids of small batches share one compiled variant of each fold kernel (a
# search of 64 tiles is three loads of 256 bytes).
MIN_TILE_BLOCK = 64


def tile_block(num_tiles: int) -> int:
    """The constexpr width of a row's tile search: a power of two covering the launch's tile grid."""
    return max(MIN_TILE_BLOCK, triton.next_power_of_2(max(1, num_tiles)))


@triton.jit
def row_slot(meta_ptr, t, n_grid, BLOCK_T: tl.constexpr, META: tl.constexpr):
    """Adapter id (int64) of token row t: the id of the batch tile holding it, -1 where none does
    (base-only and padding rows). All the grid's tile rows are loaded at once, beside the device
    header's count, which then masks the rows past it (stale from earlier batches)."""
    i = tl.arange(0, BLOCK_T)
    ok = i < n_grid
    row = meta_ptr + (i + 1) * META
    start = tl.load(row, mask=ok, other=0)
    end = tl.load(row + 1, mask=ok, other=0)
    slot = tl.load(row + 2, mask=ok, other=0)
    hit = (i < tl.load(meta_ptr)) & (start <= t) & (t < end)
    return tl.max(tl.where(hit, slot + 1, 0), axis=0).to(tl.int64) - 1


@triton.jit
def block_slots(meta_ptr, offs_m, n_grid, BLOCK_T: tl.constexpr, META: tl.constexpr):
    """`row_slot` of each row of offs_m [BLOCK_M] (int64 [BLOCK_M])."""
    i = tl.arange(0, BLOCK_T)
    ok = i < n_grid
    row = meta_ptr + (i + 1) * META
    start = tl.load(row, mask=ok, other=0)
    end = tl.load(row + 1, mask=ok, other=0)
    slot = tl.load(row + 2, mask=ok, other=0)
    live = (i < tl.load(meta_ptr))[None, :]
    hit = live & (start[None, :] <= offs_m[:, None]) & (offs_m[:, None] < end[None, :])
    return tl.max(tl.where(hit, slot[None, :] + 1, 0), axis=1).to(tl.int64) - 1


@triton.jit
def row_adapter(ranks_ptr, scal_ptr, rows_ptr, slot, s, table_width, stride_rs, stride_ri, stride_ss,
                stride_si, stride_ts, BLOCK_R: tl.constexpr):  # fmt: skip
    """Slice s of adapter `slot` (-1: none): its rank (0 for none; capped by the rank tile and the table,
    as the expand caps it), scaling, the rank offsets [BLOCK_R], which are below the rank, and their pool
    rows (int64; loaded masked by the table width, not the rank, so that the gather is in flight with
    the rank load; rows past the rank are never dereferenced)."""
    has = slot >= 0
    sid = tl.maximum(slot, 0)
    r = tl.load(ranks_ptr + sid * stride_rs + s * stride_ri, mask=has, other=0)
    scale = tl.load(scal_ptr + sid * stride_ss + s * stride_si, mask=has, other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    width = tl.where(has, table_width, 0)
    prow = tl.load(rows_ptr + sid * stride_ts + offs_r, mask=offs_r < width, other=0).to(tl.int64)
    r = tl.minimum(tl.minimum(r, BLOCK_R), table_width)
    return r, scale, offs_r, offs_r < r, prow


@triton.jit
def row_v(v_ptrs, r_ok, inv_ptr, t, bs_ptrs, stride_vp, NUM_SPLITS: tl.constexpr, INV: tl.constexpr,
          SCALED: tl.constexpr, CDT: tl.constexpr):  # fmt: skip
    """One row's v [BLOCK_R] as an expand feeds its dot: the partials summed, times the row's factor (a
    norm's shrink), times the B rows' scales (8-bit pools), rounded to CDT; returned as fp32, zero past
    the rank. The loads need no rank (the whole rank tile of v exists; what is past the rank is dropped),
    so they are issued before it is known."""
    v = tl.load(v_ptrs)
    for p in tl.static_range(1, NUM_SPLITS):
        v += tl.load(v_ptrs + p * stride_vp)
    if INV:
        v = v * tl.load(inv_ptr + t)
    if SCALED:
        v = v * tl.load(bs_ptrs, mask=r_ok, other=0.0)
    return tl.where(r_ok, v, 0.0).to(CDT).to(tl.float32)


@triton.jit
def b_tile(b_ptr, prow, r_ok, cols, col_ok, stride_br, SCALED: tl.constexpr, CDT: tl.constexpr):
    """fp32 [BLOCK_R, BLOCK_C]: the B^T rows `prow` at columns `cols`, zero past the rank (8-bit rows: in
    CDT first, as the expand converts them)."""
    mask = r_ok[:, None] & col_ok[None, :]
    b = tl.load(b_ptr + prow[:, None] * stride_br + cols[None, :], mask=mask, other=0.0)
    if SCALED:  # 8-bit rows: exact in fp32 and in CDT
        b = b.to(tl.float32).to(CDT)
    return b.to(tl.float32)


@triton.jit
def row_delta(v, b):
    """fp32 [BLOCK_C]: v [BLOCK_R] (of `row_v`) times a `b_tile`, unscaled."""
    return tl.sum(v[:, None] * b, axis=0)


@triton.jit
def tile_rows(meta_ptr, pid_b, n_grid, T, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, META: tl.constexpr):
    """The rows of program pid_b of a grid of (tiles, then blocks of BLOCK_M rows): a tile's rows (one
    adapter; none past the device header's count), or the rows of block pid_b - n_grid that no tile
    holds (base-only and padding rows). Returns (offs_m [BLOCK_M], m_ok, the rows' adapter id: int64,
    -1 for a block). Reads only the batch metadata."""
    is_tile = pid_b < n_grid
    live = is_tile & (pid_b < tl.load(meta_ptr))
    start, end, tile_slot = tile_of(meta_ptr, tl.minimum(pid_b, tl.maximum(n_grid - 1, 0)), META)
    offs_m = tl.where(is_tile, start, (pid_b - n_grid) * BLOCK_M) + tl.arange(0, BLOCK_M)
    free = block_slots(meta_ptr, offs_m, n_grid, BLOCK_T, META) < 0
    # sums of 0/1 rather than | and &: the interpreter gives a mixed scalar-vector | an integer type
    m_ok = tl.where(live & (offs_m < end), 1, 0) + tl.where((pid_b >= n_grid) & (offs_m < T) & free, 1, 0) > 0
    return offs_m, m_ok, tl.where(live, tile_slot, -1).to(tl.int64)
