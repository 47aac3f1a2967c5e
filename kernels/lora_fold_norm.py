"""RMSNorm with a LoRA expand folded in before it and a shrink after it, one launch: `fold_norm(h, w, eps,
..., d=, expand=, shrink=)` returns (h + d', w * norm(h + d')) where d' = d plus the expand's delta, and
leaves the shrink's v of the normed rows (as `kernels/lora_fold_parts.py` says: of w * (h + d'), with
each row's 1 / rms stored beside it). The layer's input norm expands the previous layer's down projection
and shrinks for q/k/v; the post-attention norm expands o and shrinks for gate/up; the final norm expands
the last down projection. Rounded as `kernels/rms_norm.py` and `lora_expand` round: d' once to the model
dtype, then the sum, the normalised row and the weighted one.

Grid: (T + tiles * column blocks * splits,). Programs below T own one token row each (the whole row in
column chunks, two passes: the sum and its squares, then the normed row); the rest are shrink programs of
one token tile (one adapter), one block of its (slice, rank) columns and one K split, each making its own
chunk of the rows' sum (the expand's delta by a dot over the tile's rows) before its dot with A."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels.batch_info import META_COLS, BatchInfo, interpreting, next_pow2
from kernels.lora_fold_parts import (
    FoldExpand,
    FoldShrink,
    b_tile,
    check_fold,
    row_adapter,
    row_delta,
    row_slot,
    row_v,
    tile_block,
)
from kernels.lora_parts import shrink_columns, split_sum, tile_of

MAX_SPLITS = 16  # K splits of a norm's shrink (the v buffers a caller keeps hold this many partials)
SHRINK_K = 64  # K step of the shrink programs
SHRINK_N = 64  # (slice, rank) columns of a shrink program at most
MAX_UNROLL = 8  # a row's column chunks unrolled up to this many (more: a loop, which compiles in seconds)


@triton.jit
def _norm_row(
    pid, h_ptr, d_ptr, w_ptr, sum_ptr, x_ptr, inv_ptr, ve_ptr, be_ptr, bes_ptr, re_ptr, se_ptr,
    a_ptr, as_ptr, vs_ptr, rs_ptr, rows_ptr, meta_ptr,
    T, H, eps, n_grid, table_width, k_per_split, col_blocks,
    stride_h, stride_d, stride_sum, stride_x, stride_vep, stride_vet, stride_ber, stride_besr,
    stride_res, stride_ses, stride_ar, stride_ai, stride_asr, stride_rss, stride_rsi, stride_ts,
    stride_vsp, stride_vst, stride_vsi,
    ADD: tl.constexpr, EXPAND: tl.constexpr, SHRINK: tl.constexpr, PE: tl.constexpr,
    NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NCH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, UPCAST: tl.constexpr, META: tl.constexpr, SCALED_E: tl.constexpr,
    SCALED_S: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """Program `pid` < T: token row pid, whole, in column chunks: its sum (with the expand's delta), its
    1 / rms, its normed row."""
    cdt = x_ptr.dtype.element_ty
    t = pid.to(tl.int64)
    if EXPAND:
        slot = row_slot(meta_ptr, t, n_grid, BLOCK_T, META)
        r, scale, offs_r, r_ok, prow = row_adapter(
            re_ptr, se_ptr, rows_ptr, slot, 0, table_width, stride_res, 0, stride_ses, 0, stride_ts,
            BLOCK_R,
        )  # fmt: skip
    else:  # never read: the chunks' arguments exist either way
        scale, r_ok, prow = 0.0, tl.arange(0, BLOCK_R) < 0, tl.zeros([BLOCK_R], dtype=tl.int64)
    if PDL:
        gdc_wait()
    if EXPAND:
        v = row_v(ve_ptr + t * stride_vet + tl.arange(0, BLOCK_R), r_ok, inv_ptr, t,
                  bes_ptr + prow * stride_besr, stride_vep, PE, False, SCALED_E, cdt)  # fmt: skip
    else:
        v = tl.zeros([BLOCK_R], dtype=tl.float32)
    squares = tl.zeros([BLOCK_C], dtype=tl.float32)
    if UNROLL:  # the chunks' loads in flight together
        for c in tl.static_range(NCH):
            squares += _sum_chunk(
                c, t, h_ptr, d_ptr, sum_ptr, be_ptr, v, prow, r_ok, scale, H, stride_h, stride_d, stride_sum,
                stride_ber, ADD, EXPAND, SCALED_E, BLOCK_C, cdt,
            )  # fmt: skip
    else:  # many narrow chunks (wide rank tiles): a loop, not NCH copies of the code
        for c in range(NCH):
            squares += _sum_chunk(
                c, t, h_ptr, d_ptr, sum_ptr, be_ptr, v, prow, r_ok, scale, H, stride_h, stride_d, stride_sum,
                stride_ber, ADD, EXPAND, SCALED_E, BLOCK_C, cdt,
            )  # fmt: skip
    inv = tl.rsqrt(tl.sum(squares, axis=0) / H + eps)
    if SHRINK:
        tl.store(inv_ptr + t, inv)
    if ADD:
        tl.debug_barrier()  # the sum's stores before any thread reads them back
        src = sum_ptr + t * stride_sum
    else:
        src = h_ptr + t * stride_h
    if UNROLL:
        for c in tl.static_range(NCH):
            _norm_chunk(c, t, src, w_ptr, x_ptr, inv, H, stride_x, BLOCK_C)
    else:
        for c in range(NCH):
            _norm_chunk(c, t, src, w_ptr, x_ptr, inv, H, stride_x, BLOCK_C)


@triton.jit
def _sum_chunk(c, t, h_ptr, d_ptr, sum_ptr, be_ptr, v, prow, r_ok, scale, H, stride_h, stride_d, stride_sum,
               stride_ber, ADD: tl.constexpr, EXPAND: tl.constexpr, SCALED_E: tl.constexpr,
               BLOCK_C: tl.constexpr, CDT: tl.constexpr):  # fmt: skip
    """Chunk c of row t's sum h + d' (stored), d' = d + the expand's delta rounded once as the expand
    stores it; returns the chunk's squares (fp32)."""
    cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < H
    x = tl.load(h_ptr + t * stride_h + cols, mask=ok, other=0.0)
    if ADD:
        d = tl.load(d_ptr + t * stride_d + cols, mask=ok, other=0.0)
        if EXPAND:
            delta = row_delta(v, b_tile(be_ptr, prow, r_ok, cols, ok, stride_ber, SCALED_E, CDT))
            d = (d.to(tl.float32) + delta * scale).to(d.dtype)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual, rounded as torch rounds it
        tl.store(sum_ptr + t * stride_sum + cols, x, mask=ok)
    xf = x.to(tl.float32)
    return xf * xf


@triton.jit
def _norm_chunk(c, t, src, w_ptr, x_ptr, inv, H, stride_x, BLOCK_C: tl.constexpr):
    """Chunk c of row t's normed row, rounded as kernels/rms_norm.py rounds it."""
    cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < H
    x = tl.load(src + cols, mask=ok, other=0.0)
    normed = (x.to(tl.float32) * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(x_ptr + t * stride_x + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok)


@triton.jit
def _norm_shrink(
    pid, h_ptr, d_ptr, w_ptr, sum_ptr, x_ptr, inv_ptr, ve_ptr, be_ptr, bes_ptr, re_ptr, se_ptr,
    a_ptr, as_ptr, vs_ptr, rs_ptr, rows_ptr, meta_ptr,
    T, H, eps, n_grid, table_width, k_per_split, col_blocks,
    stride_h, stride_d, stride_sum, stride_x, stride_vep, stride_vet, stride_ber, stride_besr,
    stride_res, stride_ses, stride_ar, stride_ai, stride_asr, stride_rss, stride_rsi, stride_ts,
    stride_vsp, stride_vst, stride_vsi,
    ADD: tl.constexpr, EXPAND: tl.constexpr, SHRINK: tl.constexpr, PE: tl.constexpr,
    NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NCH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, UPCAST: tl.constexpr, META: tl.constexpr, SCALED_E: tl.constexpr,
    SCALED_S: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """Program `pid` >= T: the shrink of one (tile, column block, K split), from its own chunk of the
    rows' sum."""
    cdt = x_ptr.dtype.element_ty
    q = pid - T
    tile = q // (col_blocks * SPLITS)
    pid_n = (q // SPLITS) % col_blocks
    pid_k = q % SPLITS
    if tile >= tl.load(meta_ptr):
        if PDL:
            gdc_wait()
        return
    start, end, slot = tile_of(meta_ptr, tile, META)
    sl, rk, in_group, prow, col_ok = shrink_columns(
        rs_ptr, rows_ptr, slot, pid_n, table_width, stride_rss, stride_rsi, stride_ts,
        NUM_SLICES, BLOCK_R, BLOCK_N,
    )  # fmt: skip
    if EXPAND:  # the expand's adapter (the tile's)
        r_e, scale_e, offs_re, re_ok, prow_e = row_adapter(
            re_ptr, se_ptr, rows_ptr, slot, 0, table_width, stride_res, 0, stride_ses, 0, stride_ts,
            BLOCK_R,
        )  # fmt: skip
    if PDL:
        gdc_wait()
    if tl.max(col_ok.to(tl.int32), axis=0) == 0:
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    rows_h = offs_m[:, None].to(tl.int64)
    if EXPAND:  # the tile's v rows
        ve = split_sum(ve_ptr + rows_h * stride_vet + offs_re[None, :], m_ok[:, None] & re_ok[None, :],
                       stride_vep, PE, "")  # fmt: skip
        if SCALED_E:
            ve = ve * tl.load(bes_ptr + prow_e * stride_besr, mask=re_ok, other=0.0)[None, :]
        ve = ve.to(cdt)
        if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
            ve = ve.to(tl.float32)
    offs_k = pid_k * k_per_split + tl.arange(0, BLOCK_K)
    a_rows = prow.to(tl.int64) * stride_ar + sl * stride_ai  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        k_ok = offs_k < H
        mk = m_ok[:, None] & k_ok[None, :]
        x = tl.load(h_ptr + rows_h * stride_h + offs_k[None, :], mask=mk, other=0.0)
        if ADD:
            df = tl.load(d_ptr + rows_h * stride_d + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
            if EXPAND:
                b = tl.load(be_ptr + prow_e[:, None] * stride_ber + offs_k[None, :],
                            mask=re_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                if SCALED_E:
                    b = b.to(tl.float32).to(cdt)
                if UPCAST:
                    b = b.to(tl.float32)
                df = (df + tl.dot(ve, b) * scale_e).to(cdt).to(tl.float32)
            x = (x.to(tl.float32) + df).to(cdt)
        w = tl.load(w_ptr + offs_k, mask=k_ok, other=0.0)
        y = (w.to(tl.float32)[None, :] * x.to(tl.float32)).to(cdt)  # w * (h + d'), before the norm
        at = tl.load(
            a_ptr + a_rows[:, None] + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
        )
        if SCALED_S:  # e4m3 and int8 values are exact in fp32 and in the model dtype
            at = at.to(tl.float32).to(cdt)
        if UPCAST:
            y = y.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(y, tl.trans(at))
        offs_k += BLOCK_K
    if SCALED_S:
        acc *= tl.load(as_ptr + prow.to(tl.int64) * stride_asr + sl, mask=col_ok, other=0.0)[None, :]
    # zeros past each rank written too: the readers load whole 16-column groups
    offs_v = rows_h * stride_vst + (sl * stride_vsi + rk)[None, :]
    tl.store(vs_ptr + pid_k * stride_vsp + offs_v, acc, mask=m_ok[:, None] & in_group[None, :])


# The token and tile counts change per batch: specialised on (1, multiples of 16), they would make
# variants per batch size that no warm-up launch names.
@triton.jit(do_not_specialize=["T", "n_grid"])
def _fold_norm_kernel(
    h_ptr, d_ptr, w_ptr, sum_ptr, x_ptr, inv_ptr, ve_ptr, be_ptr, bes_ptr, re_ptr, se_ptr,
    a_ptr, as_ptr, vs_ptr, rs_ptr, rows_ptr, meta_ptr,
    T, H, eps, n_grid, table_width, k_per_split, col_blocks,
    stride_h, stride_d, stride_sum, stride_x, stride_vep, stride_vet, stride_ber, stride_besr,
    stride_res, stride_ses, stride_ar, stride_ai, stride_asr, stride_rss, stride_rsi, stride_ts,
    stride_vsp, stride_vst, stride_vsi,
    ADD: tl.constexpr, EXPAND: tl.constexpr, SHRINK: tl.constexpr, PE: tl.constexpr,
    NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NCH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, UPCAST: tl.constexpr, META: tl.constexpr, SCALED_E: tl.constexpr,
    SCALED_S: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    # PDL: this kernel may start while the one before it (a GEMM, or o's shrink) runs. Before its wait it
    # reads only the step's constant data (the batch tiles, the adapter tables); the rows and v after it.
    # Every program passes the wait before it returns: its completion then implies its predecessor's.
    # Each kind of program in a function of its own: names of one kind never meet the other's types.
    pid = tl.program_id(0)
    if pid < T:
        _norm_row(
            pid, h_ptr, d_ptr, w_ptr, sum_ptr, x_ptr, inv_ptr, ve_ptr, be_ptr, bes_ptr, re_ptr, se_ptr,
            a_ptr, as_ptr, vs_ptr, rs_ptr, rows_ptr, meta_ptr, T, H, eps, n_grid, table_width,
            k_per_split, col_blocks, stride_h, stride_d, stride_sum, stride_x, stride_vep,
            stride_vet, stride_ber, stride_besr, stride_res, stride_ses, stride_ar, stride_ai,
            stride_asr, stride_rss, stride_rsi, stride_ts, stride_vsp, stride_vst, stride_vsi, ADD,
            EXPAND, SHRINK, PE, NUM_SLICES, BLOCK_R, BLOCK_C, NCH, BLOCK_T, BLOCK_M, BLOCK_N,
            BLOCK_K, SPLITS, UPCAST, META, SCALED_E, SCALED_S, PDL, UNROLL,
        )  # fmt: skip
    else:
        _norm_shrink(
            pid, h_ptr, d_ptr, w_ptr, sum_ptr, x_ptr, inv_ptr, ve_ptr, be_ptr, bes_ptr, re_ptr, se_ptr,
            a_ptr, as_ptr, vs_ptr, rs_ptr, rows_ptr, meta_ptr, T, H, eps, n_grid, table_width,
            k_per_split, col_blocks, stride_h, stride_d, stride_sum, stride_x, stride_vep,
            stride_vet, stride_ber, stride_besr, stride_res, stride_ses, stride_ar, stride_ai,
            stride_asr, stride_rss, stride_rsi, stride_ts, stride_vsp, stride_vst, stride_vsi, ADD,
            EXPAND, SHRINK, PE, NUM_SLICES, BLOCK_R, BLOCK_C, NCH, BLOCK_T, BLOCK_M, BLOCK_N,
            BLOCK_K, SPLITS, UPCAST, META, SCALED_E, SCALED_S, PDL, UNROLL,
        )  # fmt: skip


def norm_splits(in_dim: int) -> int:
    """K splits of a norm's shrink: the largest power of two with at least one K step of SHRINK_K each,
    at most MAX_SPLITS. Fixed by the model's width (not the batch's tiles), so that a norm has one
    compiled variant per tile search width, not one per graph: the 16 splits of an 8B step over a few
    tiles fill the GPU, and over many each program is short."""
    most = min(MAX_SPLITS, max(1, triton.cdiv(in_dim, SHRINK_K)))
    return 1 << (most.bit_length() - 1)


def shrink_blocks(num_slices: int, block_rank: int) -> tuple[int, int]:
    """(columns a shrink program, column blocks) over a group's flattened (slice, rank) columns."""
    block_n = min(SHRINK_N, next_pow2(num_slices * block_rank))
    return block_n, triton.cdiv(num_slices * block_rank, block_n)


def fold_norm(
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    info: BatchInfo,
    rows: torch.Tensor,
    *,
    d: torch.Tensor | None = None,
    expand: FoldExpand | None = None,
    shrink: FoldShrink | None = None,
    check: bool = True,
    pdl: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """h [T, H] (and the addend d [T, H]) → (h + d' or None without d, weight * norm(h + d')), new
    tensors in h's dtype. `expand` (one slice: o or down): d' = d + its delta at adapter rows (needs d).
    `shrink`: writes shrink.v [splits, T, slices, block_rank] (splits: `norm_splits`) and shrink.inv [T].
    rows: the pool's row table; info: the prepared batch (its tiles name each row's adapter). `pdl`: launch
    as a programmatic dependent (the kernel before must write neither the tiles nor the adapter tables)."""
    T, H = h.shape
    if check:
        if weight.shape != (H,) or weight.dtype != h.dtype or h.stride(-1) != 1:
            raise ValueError(
                f"weight {tuple(weight.shape)} {weight.dtype} does not match rows {tuple(h.shape)}"
            )
        if d is not None and (d.shape != h.shape or d.dtype != h.dtype or d.stride(-1) != 1):
            raise ValueError(
                f"the addend {tuple(d.shape)} {d.dtype} does not match {tuple(h.shape)} {h.dtype}"
            )
        if expand is not None and (d is None or expand.b.shape[1] < H or expand.v.shape[2] != 1):
            raise ValueError("a norm's expand is one slice of the addend's width and needs the addend")
        if expand is not None:
            check_fold(h, expand.b, expand.v, expand.ranks, info)
        if shrink is not None:
            check_fold(h, shrink.a, shrink.v, shrink.ranks, info)
            if shrink.a.shape[2] != H or shrink.inv is None or shrink.inv.numel() < T:
                raise ValueError(f"shrink A rows of {shrink.a.shape[2]} for rows of {H}, and inv [T]")
    total = torch.empty_like(h) if d is not None else None
    x = torch.empty_like(h)
    if T == 0:
        return total, x
    br = info.block_rank
    add, ex, sh = d is not None, expand is not None, shrink is not None
    num_slices = shrink.a.shape[1] if sh else 1
    block_n, col_blocks = shrink_blocks(num_slices, br)
    splits = shrink.v.shape[0] if sh else 1
    block_c = min(next_pow2(H), max(64, 8192 // br)) if ex else next_pow2(H)
    k_per_split = triton.cdiv(triton.cdiv(H, splits), SHRINK_K) * SHRINK_K
    grid = (T + (info.num_tiles * col_blocks * splits if sh else 0),)
    z = h  # stands in for absent operands (never dereferenced)
    e = expand or FoldExpand(z, z, rows, rows)
    s = shrink or FoldShrink(z, rows, z)
    inv = s.inv if sh else z
    ve_strides = (e.v.stride(0), e.v.stride(1)) if ex else (0, 0)
    _fold_norm_kernel[grid](
        h, d if add else h, weight, total if add else x, x, inv, e.v, e.b,
        e.b_scales if e.b_scales is not None else z, e.ranks, e.scalings, s.a,
        s.a_scales if s.a_scales is not None else z, s.v, s.ranks, rows, info.meta,
        T, H, eps, info.num_tiles, rows.shape[1], k_per_split, col_blocks,
        h.stride(0), d.stride(0) if add else 0, total.stride(0) if add else 0, x.stride(0), *ve_strides,
        e.b.stride(0) if ex else 0, e.b_scales.stride(0) if e.b_scales is not None else 0,
        e.ranks.stride(0), e.scalings.stride(0) if ex else 0, s.a.stride(0) if sh else 0,
        s.a.stride(1) if sh else 0, s.a_scales.stride(0) if s.a_scales is not None else 0,
        s.ranks.stride(0), s.ranks.stride(1), rows.stride(0),
        s.v.stride(0) if sh else 0, s.v.stride(1) if sh else 0, s.v.stride(2) if sh else 0,
        ADD=add, EXPAND=ex, SHRINK=sh, PE=e.v.shape[0] if ex else 1, NUM_SLICES=num_slices, BLOCK_R=br,
        BLOCK_C=block_c, NCH=triton.cdiv(H, block_c), BLOCK_T=tile_block(info.num_tiles),
        BLOCK_M=info.block_m, BLOCK_N=block_n, BLOCK_K=SHRINK_K, SPLITS=splits, UPCAST=interpreting(),
        META=META_COLS, SCALED_E=ex and e.b_scales is not None, SCALED_S=sh and s.a_scales is not None,
        PDL=pdl, UNROLL=triton.cdiv(H, block_c) <= MAX_UNROLL, launch_pdl=pdl,
        num_warps=4 if ex or sh else min(8, max(1, block_c // 256)),
    )  # fmt: skip
    return total, x


def fold_norm_ref(h, weight, eps, d=None, delta=None, a_rows=None, slots=None, ranks=None):
    """Float64 reference: (h + d + delta, its RMSNorm times weight, and per row t with adapter slots[t] >= 0
    the shrink x[t] @ A[slots[t]]^T [T, slices, R] for `a_rows` [ids, slices, R, H] below `ranks`)."""
    s = h.double() + (d.double() if d is not None else 0) + (delta.double() if delta is not None else 0)
    x = weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    v = None
    if a_rows is not None:
        v = torch.zeros((h.shape[0], a_rows.shape[1], a_rows.shape[2]), dtype=torch.float64)
        for t, slot in enumerate(slots):
            for j in range(a_rows.shape[1]) if slot >= 0 else ():
                r = int(ranks[slot, j])
                v[t, j, :r] = a_rows[slot, j, :r].double() @ x[t]
    return s, x, v
