"""Multi-LoRA expand (SGMV): out[t, off_s:off_s+d_s] += scaling_s * v[t, s, :r] @ B_s[:r] for every token
tile of one adapter, all slices of a fused group (unequal widths) in one launch, rank-bounded K loop. The
adapter's B^T rows are found anywhere in a rank-row pool through its row of the row table. An 8-bit
(e4m3 or int8) pool's B^T rows are converted to out's dtype and each rank column of v is scaled by its
row's scale before the dot (SCALED, a constexpr: `kernels/lora_quant.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels import device_info
from kernels.batch_info import ACT_BLOCK_M, META_COLS, BatchInfo, interpreting, read_tiles
from kernels.lora_parts import (
    b_chunk,
    b_rows,
    b_scale_chunk,
    chunk_dot,
    expand_block,
    row_gather,
    slice_block,
    tile_of,
    v_chunk,
)
from kernels.lora_quant import check_scales
from kernels.lora_shrink import check_row_table


@triton.jit
def _lora_expand_kernel(
    v_ptr,
    b_ptr,
    bs_ptr,
    out_ptr,
    ranks_ptr,
    scal_ptr,
    rows_ptr,
    meta_ptr,
    table_width,
    d0,
    d1,
    d2,
    o0,
    o1,
    o2,
    stride_vp,
    stride_vt,
    stride_vi,
    stride_br,
    stride_bsr,
    stride_rs,
    stride_ri,
    stride_ss,
    stride_si,
    stride_ts,
    stride_ot,
    NUM_SLICES: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    META: tl.constexpr,
    SKIP_UNIFORM: tl.constexpr,
    ACT_BM: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    # Grid: (tiles, column blocks of all slices; a block never straddles two slices).
    # PDL: this kernel may start while the shrink before it runs (the shrink lets it). Before its wait it
    # reads only the step's constant data (the batch metadata, the adapter tables and the first chunk of
    # B rows); v and out after it. Every program passes the wait before it returns, so that this
    # kernel's completion implies the shrink's. It does not let the kernel after it start early: where
    # that is the next group's shrink, an early shrink makes rank-16 steps up to 18 % slower.
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_t >= tl.load(meta_ptr):
        if PDL:
            gdc_wait()
        return
    start, end, slot = tile_of(meta_ptr, pid_t, META)
    s, n0, width, off = slice_block(pid_n, d0, d1, d2, o0, o1, o2, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K)
    t_ptrs = rows_ptr + slot * stride_ts + offs_r  # [BLOCK_K] row table entries of the first chunk
    r = tl.load(ranks_ptr + slot * stride_rs + s * stride_ri)
    if BLOCK_K == BLOCK_R and NUM_SPLITS == 1:  # single step: its gather in flight with the rank load
        prow0 = row_gather(t_ptrs, 0, offs_r, table_width)
    # A rank past the table would index the next adapter's entries.
    r = tl.minimum(tl.minimum(r, BLOCK_R), table_width)
    if r == 0:
        if PDL:
            gdc_wait()
        return
    scale = tl.load(scal_ptr + slot * stride_ss + s * stride_si)

    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    if SKIP_UNIFORM:  # rows of blocks with one adapter get their delta in kernels/lora_expand_act.py
        blk = tl.load(meta_ptr + (offs_m // ACT_BM + 1) * META + 3, mask=m_ok, other=0)
        m_ok = m_ok & (blk < 0)
        if tl.max(m_ok.to(tl.int32), axis=0) == 0:
            if PDL:
                gdc_wait()
            return
    # The shrink wrote v in whole 16-column groups (zeros past the rank), so v loads need no rank mask
    # below r16; B rows past the real rank are stale and are never read.
    r16 = tl.cdiv(r, 16) * 16
    o_ptrs, o_mask, n_ok, b_cols, bs_col, v_ptrs = expand_block(
        out_ptr, v_ptr, b_ptr, bs_ptr, offs_m, m_ok, s, n0, width, off, offs_r, stride_ot, stride_vt,
        stride_vi, BLOCK_N,
    )  # fmt: skip
    cdt = out_ptr.dtype.element_ty
    if BLOCK_K == BLOCK_R and NUM_SPLITS == 1:  # one step, loads straight to registers (no pipeline)
        bt = b_chunk(b_cols, prow0, 0, r, n_ok, offs_r, stride_br)  # before the wait: adapter rows
        bs = b_scale_chunk(bs_col, prow0, 0, r, offs_r, stride_bsr, SCALED)
        if PDL:
            gdc_wait()
        o = tl.load(o_ptrs, mask=o_mask, other=0.0)
        acc = chunk_dot(v_chunk(v_ptrs, 0, r16, m_ok, offs_r, stride_vp, NUM_SPLITS, ""), bt, bs, UPCAST, cdt)
    else:
        if PDL:
            gdc_wait()
        o = tl.load(o_ptrs, mask=o_mask, other=0.0)  # issued early: its latency hides behind the rank loop
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, r, BLOCK_K):
            bt, bs = b_rows(
                t_ptrs, b_cols, bs_col, k, r, n_ok, offs_r, table_width, stride_br, stride_bsr, SCALED
            )
            vt = v_chunk(v_ptrs, k, r16, m_ok, offs_r, stride_vp, NUM_SPLITS, "")
            acc += chunk_dot(vt, bt, bs, UPCAST, cdt)
    tl.store(o_ptrs, (o.to(tl.float32) + acc * scale).to(o.dtype), mask=o_mask)


@dataclass(frozen=True)
class ExpandConfig:
    block_n: int
    block_k: int  # rank rows per step of the rank loop
    num_warps: int = 4
    num_stages: int = 2
    pdl: bool = False  # as `ShrinkConfig.pdl`


def expand_config(info: BatchInfo, out_dims: Sequence[int], split_k: int = 1) -> ExpandConfig:
    """Heuristic block shape from host-known sizes (tuned on an H100, see docs/kernels.md): wide column
    tiles for small ranks; the whole rank (up to 64) per step unless many split-K partials would make
    the pipelined v tiles too large, then 16 rank rows per step."""
    br, bm = info.block_rank, info.block_m
    block_n = 256 if bm <= 16 and br <= 16 else 128
    return ExpandConfig(
        block_n=block_n,
        block_k=rank_chunk(br, bm, split_k),
        num_warps=4,
        num_stages=2,
        pdl=device_info.pdl_for(info.meta.device, info.num_tiles),
    )


def rank_chunk(block_rank: int, block_m: int, split_k: int) -> int:
    """Rank rows per dot of an expand: the whole rank up to 64, or 16 where the `split_k` fp32 partials
    of a `block_m`-row v tile would pass 32 KiB."""
    block_k = min(block_rank, 64)
    return 16 if split_k * block_m * block_k * 4 > 32 * 1024 else block_k


def _check(v, b, ranks, scalings, rows, out, out_offsets, out_dims, info, b_scales=None) -> tuple[int, int]:
    if v.dim() != 4 or b.dim() != 2 or out.dim() != 2 or ranks.dim() != 2:
        raise ValueError(
            f"expected v [P, T, N, R], b [P, D], ranks [I, N], out [T, D]; got {v.shape}, {b.shape}, "
            f"{ranks.shape}, {out.shape}"
        )
    splits, T, num_slices, br = v.shape
    num_ids = ranks.shape[0]
    if not 1 <= num_slices <= 3 or len(out_offsets) != num_slices or len(out_dims) != num_slices:
        raise ValueError(
            f"1 to 3 slices with one offset and width each, got {num_slices}, {out_offsets}, {out_dims}"
        )
    if v.dtype != torch.float32 or not v.is_contiguous() or br != info.block_rank:
        raise ValueError(
            f"v must be contiguous float32 [P, T, N, {info.block_rank}], got {v.dtype} {tuple(v.shape)}"
        )
    if T != info.num_tokens or out.shape[0] != T:
        raise ValueError(f"v/out have {T}/{out.shape[0]} tokens, batch was prepared for {info.num_tokens}")
    for name, t, dt in (("ranks", ranks, torch.int32), ("scalings", scalings, torch.float32)):
        if tuple(t.shape) != (num_ids, num_slices) or t.dtype != dt:
            raise ValueError(f"{name} must be {dt} [{num_ids}, {num_slices}], got {t.dtype} {tuple(t.shape)}")
    check_row_table(rows, num_ids, info)
    check_scales("B", b, b_scales, num_slices)
    b_dtype = out.dtype if b_scales is not None else b.dtype
    if b_dtype != out.dtype or b_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"B and out must share a float dtype (or B be e4m3), got {b.dtype} and {out.dtype}")
    if b.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("B rows and out rows must be contiguous in their last dim")
    total = max(o + d for o, d in zip(out_offsets, out_dims, strict=True))
    if total > b.shape[1] or total > out.shape[1] or min(out_dims) <= 0 or min(out_offsets) < 0:
        raise ValueError(
            f"slices {out_offsets}/{out_dims} do not fit B ({b.shape[1]}) and out ({out.shape[1]})"
        )
    if not (v.device == b.device == ranks.device == scalings.device == out.device == info.meta.device):
        raise ValueError("v, B, ranks, scalings, out and the batch metadata must be on one device")
    return splits, num_slices


def lora_expand(
    v: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    out_offsets: Sequence[int],
    out_dims: Sequence[int],
    info: BatchInfo,
    *,
    config: ExpandConfig | None = None,
    check: bool = True,
    skip_uniform: bool = False,
    pdl: bool = False,
    b_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """v [splits, T, num_slices, block_rank] fp32 partials (from `lora_shrink`); b [pool_rows, D] (one
    layer's B^T rows of the rank-row pool, strided view, last dim contiguous); ranks/scalings [num_ids,
    num_slices] int32/fp32; rows [num_ids, width] int32 (as for `lora_shrink`); all on the device. out
    [T, D] updated in place, only at adapter tokens and slices of nonzero rank. `check=False` skips
    validating the arguments (the backend's hot path). `skip_uniform`: leave the rows of ACT_BLOCK_M-row
    blocks whose rows all have one adapter (the metadata's column 3) to `lora_expand_silu_mul`. `pdl`:
    launch as a programmatic dependent where the config says so (`ExpandConfig.pdl`); the caller
    promises that the kernel just before this one wrote neither the batch metadata, the adapter tables
    nor B (this kernel reads them before its wait). `b_scales`: [pool_rows, num_slices] fp32, the scales
    of an e4m3 pool's B^T rows (`b` is then e4m3)."""
    if check:
        splits, num_slices = _check(v, b, ranks, scalings, rows, out, out_offsets, out_dims, info, b_scales)
    else:
        splits, num_slices = v.shape[0], v.shape[2]
    cfg = config or expand_config(info, out_dims)
    if check and (cfg.block_k > info.block_rank or info.block_rank % cfg.block_k):
        raise ValueError(f"block_k={cfg.block_k} must divide block_rank={info.block_rank}")
    if check and skip_uniform and info.row_blocks * ACT_BLOCK_M < info.num_tokens:
        raise ValueError(f"skip_uniform needs the metadata's row blocks: {info.row_blocks} of {ACT_BLOCK_M}")
    if info.num_tiles == 0:
        return out
    d = list(out_dims) + [0] * (3 - num_slices)
    o = list(out_offsets) + [0] * (3 - num_slices)
    grid = (info.num_tiles, sum(triton.cdiv(w, cfg.block_n) for w in out_dims))
    pdl = pdl and cfg.pdl
    _lora_expand_kernel[grid](
        v,
        b,
        b if b_scales is None else b_scales,  # never dereferenced without scales
        out,
        ranks,
        scalings,
        rows,
        info.meta,
        rows.shape[1],
        *d,
        *o,
        v.stride(0),
        v.stride(1),
        v.stride(2),
        b.stride(0),
        0 if b_scales is None else b_scales.stride(0),
        ranks.stride(0),
        ranks.stride(1),
        scalings.stride(0),
        scalings.stride(1),
        rows.stride(0),
        out.stride(0),
        NUM_SLICES=num_slices,
        NUM_SPLITS=splits,
        BLOCK_R=info.block_rank,
        BLOCK_M=info.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UPCAST=interpreting(),
        META=META_COLS,
        SKIP_UNIFORM=skip_uniform,
        ACT_BM=ACT_BLOCK_M,
        PDL=pdl,
        SCALED=b_scales is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    return out


def lora_expand_ref(
    v: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    out_offsets: Sequence[int],
    out_dims: Sequence[int],
    info: BatchInfo,
    b_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, in place on out: v is [splits, T, N, R] partials or an already summed [T, N, R]."""
    vs = v.sum(0) if v.dim() == 4 else v  # [T, N, R]
    host_ranks, host_scal = ranks.cpu(), scalings.cpu()
    for start, end, slot in read_tiles(info):
        for s, (off, width) in enumerate(zip(out_offsets, out_dims, strict=True)):
            r = min(int(host_ranks[slot, s]), info.block_rank, rows.shape[1])
            if r == 0:
                continue
            idx = rows[slot, :r].long()
            vr = vs[start:end, s, :r]
            if b_scales is not None:  # e4m3 rows: v times each row's scale, in out's dtype
                vr = vr * b_scales[idx, s]
            vr = vr.to(out.dtype if b_scales is not None else b.dtype).float()  # rounded as the kernel does
            delta = vr @ b[idx, off : off + width].float()  # gathered pool rows
            out[start:end, off : off + width] = (
                out[start:end, off : off + width].float() + delta * float(host_scal[slot, s])
            ).to(out.dtype)
    return out
