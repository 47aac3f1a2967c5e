"""A fused group's whole LoRA delta in one launch: the shrink's programs (as `lora_shrink`, split-K partials
left for the expand) and the expand's (as `lora_expand`) in one grid, each expand program waiting in the
kernel for its token tile's shrink programs instead of the launch boundary between two kernels. For small
batches, where a step's LoRA time is the latency of its launches more than its bytes.

A fixed number of programs (PROGRAMS_PER_SM a streaming multiprocessor) draw work items from an atomic
counter until the batch's are done: every shrink item of the batch's tiles (the device header's count)
before any expand item. An expand item waits only on shrink items drawn before it, by programs that are
running and never wait themselves, so the wait ends whatever the hardware's dispatch order and however
few programs fit at once. A shrink item counts itself in at its tile's counter after its stores; an
expand item loads its adapter's first B^T rows and the output, waits there for the tile's shrinks, then
counts itself in too. The last of a tile's items to count in resets its counter, and the last draw of
all (one past the items per program) the item counter, so that every launch finds them zero."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels import device_info
from kernels.batch_info import META_COLS, BatchInfo, interpreting
from kernels.lora_expand import ExpandConfig
from kernels.lora_parts import (
    b_rows,
    chunk_dot,
    expand_block,
    shrink_columns,
    shrink_dot,
    slice_block,
    tile_of,
    v_chunk,
)
from kernels.lora_shrink import ShrinkConfig

SYNC_HEAD = 1  # sync buffer: [work items drawn, then per tile the programs counted in]
# Programs of a fused launch per SM: enough to hide each one's latency, few enough that empty ones (the
# batch has fewer items than a graph's grid can hold) cost little.
PROGRAMS_PER_SM = 2


@triton.jit
def _shrink_part(
    x_ptr, a_ptr, as_ptr, v_ptr, ranks_ptr, rows_ptr, meta_ptr, pid_t, pid_n, pid_k,
    K, k_per_split, table_width, stride_xt, stride_ar, stride_ai, stride_asr, stride_rs, stride_ri,
    stride_ts, stride_vp, stride_vt, stride_vi,
    NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, META: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """One shrink program of `lora_shrink` without its own split sum: partial pid_k of x @ A^T for the
    tile's rows and column block pid_n, zeros past each rank (whole 16-column groups for the expand)."""
    start, end, slot = tile_of(meta_ptr, pid_t, META)
    sl, rk, in_group, prow, col_ok = shrink_columns(
        ranks_ptr, rows_ptr, slot, pid_n, table_width, stride_rs, stride_ri, stride_ts,
        NUM_SLICES, BLOCK_R, BLOCK_N,
    )  # fmt: skip
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    acc = shrink_dot(
        x_ptr, a_ptr, as_ptr, offs_m, m_ok, pid_k * k_per_split, K, k_per_split, sl, prow, col_ok,
        stride_xt, stride_ar, stride_ai, stride_asr, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, SCALED,
    )  # fmt: skip
    offs_v = offs_m[:, None].to(tl.int64) * stride_vt + (sl * stride_vi + rk)[None, :]
    tl.store(v_ptr + pid_k * stride_vp + offs_v, acc, mask=m_ok[:, None] & in_group[None, :])


@triton.jit
def _count_in(count_ptr, tile_total):
    """Count this program in at its tile's counter; the last of the tile's programs resets it."""
    if tl.atomic_add(count_ptr, 1, sem="release") == tile_total - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")


@triton.jit
def _expand_part(
    v_ptr, b_ptr, bs_ptr, out_ptr, ranks_ptr, scal_ptr, rows_ptr, meta_ptr, count_ptr, pid_t, pid_n,
    shrinks_per_tile, tile_total, table_width, d0, d1, d2, o0, o1, o2, stride_vp, stride_vt, stride_vi,
    stride_br, stride_bsr, stride_rs, stride_ri, stride_ss, stride_si, stride_ts, stride_ot,
    NUM_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, META: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """One expand program of `lora_expand`: out[tile rows, column block pid_n] += scaling * v @ B, once
    the tile's `shrinks_per_tile` shrink programs have counted themselves in at `count_ptr` (of
    `tile_total` programs that count there)."""
    start, end, slot = tile_of(meta_ptr, pid_t, META)
    s, n0, width, off = slice_block(pid_n, d0, d1, d2, o0, o1, o2, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K)
    t_ptrs = rows_ptr + slot * stride_ts + offs_r
    r = tl.load(ranks_ptr + slot * stride_rs + s * stride_ri)
    r = tl.minimum(tl.minimum(r, BLOCK_R), table_width)
    scale = tl.load(scal_ptr + slot * stride_ss + s * stride_si)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < tl.where(r > 0, end, start)  # a slice of rank 0 is left as it is
    r16 = tl.cdiv(r, 16) * 16
    o_ptrs, o_mask, n_ok, b_cols, bs_col, v_ptrs = expand_block(
        out_ptr, v_ptr, b_ptr, bs_ptr, offs_m, m_ok, s, n0, width, off, offs_r, stride_ot, stride_vt,
        stride_vi, BLOCK_N,
    )  # fmt: skip
    cdt = out_ptr.dtype.element_ty
    # Before the wait: the first chunk of adapter rows and the output (the launch's own predecessors
    # wrote it), whose latency then hides behind the shrinks.
    bt, bs = b_rows(t_ptrs, b_cols, bs_col, 0, r, n_ok, offs_r, table_width, stride_br, stride_bsr, SCALED)
    o = tl.load(o_ptrs, mask=o_mask, other=0.0)
    seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    while seen < shrinks_per_tile:  # only shrinks count before any expand has passed here
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    _count_in(count_ptr, tile_total)
    # v is read past L1: other programs of this launch wrote it.
    vt = v_chunk(v_ptrs, 0, r16, m_ok, offs_r, stride_vp, NUM_SPLITS, ".cg")
    acc = chunk_dot(vt, bt, bs, UPCAST, cdt)
    for k in range(BLOCK_K, r, BLOCK_K):
        bt, bs = b_rows(
            t_ptrs, b_cols, bs_col, k, r, n_ok, offs_r, table_width, stride_br, stride_bsr, SCALED
        )
        vt = v_chunk(v_ptrs, k, r16, m_ok, offs_r, stride_vp, NUM_SPLITS, ".cg")
        acc += chunk_dot(vt, bt, bs, UPCAST, cdt)
    tl.store(o_ptrs, (o.to(tl.float32) + acc * scale).to(o.dtype), mask=o_mask)


@triton.jit
def _lora_fused_kernel(
    x_ptr, a_ptr, as_ptr, v_ptr, b_ptr, bs_ptr, out_ptr, ranks_ptr, scal_ptr, rows_ptr, meta_ptr, sync_ptr,
    K, k_per_split, table_width, shrink_cols, expand_cols, d0, d1, d2, o0, o1, o2,
    stride_xt, stride_ar, stride_ai, stride_asr, stride_vp, stride_vt, stride_vi, stride_br, stride_bsr,
    stride_rs, stride_ri, stride_ss, stride_si, stride_ts, stride_ot,
    NUM_SLICES: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    SHRINK_N: tl.constexpr, SHRINK_K: tl.constexpr, EXPAND_N: tl.constexpr, EXPAND_K: tl.constexpr,
    HEAD: tl.constexpr, UPCAST: tl.constexpr, META: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    # Grid: (a fixed number of programs,), each drawing work items until none is left: the batch's shrink
    # items (tile, column block, split) first, then its expand items (tile, column block), so that the
    # grid does not follow the tile count a graph must cover, only the batch's own tiles get work.
    # PDL: the kernel before may still run; every program waits first (then its completion implies its
    # predecessor's), and the prologue saved is the launch itself.
    if PDL:
        gdc_wait()
    per_tile = shrink_cols * SPLITS
    n_tiles = tl.load(meta_ptr)  # the device header's tile count
    n_shrink = n_tiles * per_tile
    n_items = n_shrink + n_tiles * expand_cols
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while item < n_items:
        if item < n_shrink:
            pid_t = item // per_tile
            role = item % per_tile
            _shrink_part(
                x_ptr, a_ptr, as_ptr, v_ptr, ranks_ptr, rows_ptr, meta_ptr, pid_t, role // SPLITS,
                role % SPLITS, K, k_per_split, table_width, stride_xt, stride_ar, stride_ai, stride_asr,
                stride_rs, stride_ri, stride_ts, stride_vp, stride_vt, stride_vi,
                NUM_SLICES, BLOCK_R, BLOCK_M, SHRINK_N, SHRINK_K, UPCAST, META, SCALED,
            )  # fmt: skip
            tl.debug_barrier()  # every thread's stores before the count's release
            _count_in(sync_ptr + HEAD + pid_t, per_tile + expand_cols)
        else:
            pid_t = (item - n_shrink) // expand_cols
            _expand_part(
                v_ptr, b_ptr, bs_ptr, out_ptr, ranks_ptr, scal_ptr, rows_ptr, meta_ptr,
                sync_ptr + HEAD + pid_t, pid_t, (item - n_shrink) % expand_cols, per_tile,
                per_tile + expand_cols, table_width, d0, d1, d2, o0, o1, o2, stride_vp, stride_vt,
                stride_vi, stride_br, stride_bsr, stride_rs, stride_ri, stride_ss, stride_si, stride_ts,
                stride_ot, SPLITS, BLOCK_R, BLOCK_M, EXPAND_N, EXPAND_K, UPCAST, META, SCALED,
            )  # fmt: skip
        item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    # Each program draws once past the items: the last draw of all resets the counter.
    if item == n_items + tl.num_programs(0) - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")


@dataclass(frozen=True)
class FusedConfig:
    """The expand half's config of a fused launch (its shrink half's is the group's ShrinkConfig, whose
    `reduce` the launch ignores): the backend's mark that a group runs as one launch."""

    expand: ExpandConfig

    @property
    def pdl(self) -> bool:
        return self.expand.pdl


def sync_buffer(max_tiles: int, device) -> torch.Tensor:
    """A zeroed sync buffer for launches of at most `max_tiles` grid tiles (every launch leaves it zero)."""
    return torch.zeros(SYNC_HEAD + max(1, max_tiles), dtype=torch.int32, device=device)


def _check(x, a, b, v, out, sync, info: BatchInfo, shrink: ShrinkConfig, expand: ExpandConfig) -> None:
    """What the fused launch asks beyond the two kernels' own checks (`lora_shrink`, `lora_expand`)."""
    T, num_slices, br = x.shape[0], a.shape[1], info.block_rank
    shape = (shrink.split_k, T, num_slices, br)
    if tuple(v.shape) != shape or v.dtype != torch.float32 or not v.is_contiguous():
        raise ValueError(f"v must be contiguous float32 {shape}, got {v.dtype} {tuple(v.shape)}")
    need = SYNC_HEAD + info.num_tiles
    if sync.dtype != torch.int32 or sync.numel() < need or sync.device != x.device:
        raise ValueError(
            f"sync must be int32 with at least {need} elements on {x.device}, "
            f"got {sync.dtype} {sync.numel()} on {sync.device}"
        )
    if expand.block_k > br or br % expand.block_k or expand.block_k < 16:
        raise ValueError(f"expand block_k={expand.block_k} must be >= 16 and divide block_rank={br}")
    if shrink.block_n > br and shrink.block_n % br or shrink.block_n < br and br % shrink.block_n:
        raise ValueError(f"shrink block_n={shrink.block_n} and block_rank={br}: one must divide the other")


def lora_shrink_expand(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    out_offsets: Sequence[int],
    out_dims: Sequence[int],
    info: BatchInfo,
    *,
    v: torch.Tensor,
    sync: torch.Tensor,
    shrink: ShrinkConfig,
    expand: ExpandConfig,
    check: bool = True,
    pdl: bool = False,
    a_scales: torch.Tensor | None = None,
    b_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """out += the group's LoRA delta, as `lora_shrink` then `lora_expand` with these configs add it (the
    shrink never sums its partials itself: `shrink.reduce` is ignored), in one launch. Operands as for
    those two; `v` [shrink.split_k, T, slices, block_rank] fp32 scratch for the partials (any content);
    `sync` int32 of at least SYNC_HEAD + info.num_tiles elements, zero (every launch leaves it zero; one
    launch at a time may use it). `pdl`: launch as a programmatic dependent where the expand config
    says so."""
    if check:
        from kernels.lora_expand import _check as check_expand
        from kernels.lora_shrink import _check as check_shrink

        check_shrink(x, a, ranks, rows, info, shrink, None, None, a_scales)
        check_expand(v, b, ranks, scalings, rows, out, out_offsets, out_dims, info, b_scales)
        _check(x, a, b, v, out, sync, info, shrink, expand)
    if info.num_tiles == 0:
        return out
    K, num_slices, br = x.shape[1], a.shape[1], info.block_rank
    shrink_cols = triton.cdiv(num_slices * br, shrink.block_n)
    expand_cols = sum(triton.cdiv(w, expand.block_n) for w in out_dims)
    d = list(out_dims) + [0] * (3 - num_slices)
    o = list(out_offsets) + [0] * (3 - num_slices)
    k_per_split = triton.cdiv(triton.cdiv(K, shrink.split_k), shrink.block_k) * shrink.block_k
    pdl = pdl and expand.pdl
    items = info.num_tiles * (shrink_cols * shrink.split_k + expand_cols)  # the most a batch can have
    grid = (min(items, PROGRAMS_PER_SM * device_info.num_sms(x.device)),)
    _lora_fused_kernel[grid](
        x, a, a if a_scales is None else a_scales, v, b, b if b_scales is None else b_scales, out, ranks,
        scalings, rows, info.meta, sync, K, k_per_split, rows.shape[1], shrink_cols,
        expand_cols, *d, *o, x.stride(0), a.stride(0), a.stride(1),
        0 if a_scales is None else a_scales.stride(0), v.stride(0), v.stride(1), v.stride(2), b.stride(0),
        0 if b_scales is None else b_scales.stride(0), ranks.stride(0), ranks.stride(1),
        scalings.stride(0), scalings.stride(1), rows.stride(0), out.stride(0),
        NUM_SLICES=num_slices, SPLITS=shrink.split_k, BLOCK_R=br, BLOCK_M=info.block_m,
        SHRINK_N=shrink.block_n, SHRINK_K=shrink.block_k, EXPAND_N=expand.block_n,
        EXPAND_K=expand.block_k, HEAD=SYNC_HEAD, UPCAST=interpreting(),
        META=META_COLS, PDL=pdl, SCALED=a_scales is not None, num_warps=expand.num_warps,
        num_stages=min(shrink.num_stages, 2), launch_pdl=pdl,
    )  # fmt: skip
    return out
