"""The gated activation with the gate/up LoRA expand folded in before it and the down projection's shrink
after it, one launch: act = silu(gate + delta) * (up + delta), rounded as `kernels/lora_expand_act.py`
rounds it, and the down shrink's v as one fp32 partial per block of activation columns (the reader sums
them; no atomics). gate/up's v comes from the shrink folded into the post-attention norm (partials, times
each row's 1 / rms: `kernels/lora_fold_parts.py`).

Grid: (tiles + row blocks, column groups of NB * BLOCK_N activation columns). A tile program takes its
token tile (one adapter) through the expand, the activation and the shrink with one dot each a column
block; a row-block program takes the rows of its block that no tile holds (base-only and padding rows)
through the plain activation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels.batch_info import META_COLS, BatchInfo, interpreting
from kernels.lora_fold_parts import FoldExpand, FoldShrink, check_fold, tile_block, tile_rows
from kernels.lora_parts import split_sum

MAX_PARTIALS = 32  # the down shrink's partials at most (column groups of the activation)


# The token and tile counts change per batch: specialised on (1, multiples of 16), they would make
# variants per batch size that no warm-up launch names.
@triton.jit(do_not_specialize=["T", "n_grid"])
def _fold_act_kernel(
    gu_ptr, act_ptr, v_ptr, inv_ptr, b_ptr, bs_ptr, ranks_ptr, scal_ptr, a_ptr, as_ptr, vd_ptr, rd_ptr,
    rows_ptr, meta_ptr,
    T, inter, n_grid, table_width,
    stride_gt, stride_at, stride_vp, stride_vt, stride_vi, stride_br, stride_bsr, stride_bsi,
    stride_rs, stride_ri, stride_ss, stride_si, stride_ar, stride_asr, stride_rds, stride_ts,
    stride_vdp, stride_vdt,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
    BLOCK_T: tl.constexpr, SPLITS: tl.constexpr, META: tl.constexpr, SHRINK: tl.constexpr,
    UPCAST: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # PDL: this kernel may start while the gate/up GEMM before it runs. Before its wait it reads only the
    # step's constant data (the batch tiles, the adapter tables); gate_up, v, inv and the adapter rows
    # after it. Every program passes the wait before it returns.
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, m_ok, slot = tile_rows(meta_ptr, pid_b, n_grid, T, BLOCK_M, BLOCK_T, META)
    if tl.max(m_ok.to(tl.int32), axis=0) == 0:
        if PDL:
            gdc_wait()
        return
    has = slot >= 0
    sid = tl.maximum(slot, 0)
    cap = tl.minimum(BLOCK_R, table_width)  # a rank past the table would index the next id's rows
    rg = tl.minimum(tl.load(ranks_ptr + sid * stride_rs, mask=has, other=0), cap)
    ru = tl.minimum(tl.load(ranks_ptr + sid * stride_rs + stride_ri, mask=has, other=0), cap)
    if SHRINK:
        rd = tl.minimum(tl.load(rd_ptr + sid * stride_rds, mask=has, other=0), cap)
    else:
        rd = 0
    sg = tl.load(scal_ptr + sid * stride_ss, mask=has, other=0.0)
    su = tl.load(scal_ptr + sid * stride_ss + stride_si, mask=has, other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    g_ok, u_ok, d_ok = offs_r < rg, offs_r < ru, offs_r < rd
    prow = tl.load(rows_ptr + sid * stride_ts + offs_r, mask=g_ok | u_ok | d_ok, other=0).to(tl.int64)
    if PDL:
        gdc_wait()
    cdt = act_ptr.dtype.element_ty
    rows_m = offs_m[:, None].to(tl.int64)
    v_rows = v_ptr + rows_m * stride_vt + offs_r[None, :]
    inv = tl.load(inv_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    vg = split_sum(v_rows, m_ok[:, None] & g_ok[None, :], stride_vp, SPLITS, "") * inv
    vu = split_sum(v_rows + stride_vi, m_ok[:, None] & u_ok[None, :], stride_vp, SPLITS, "") * inv
    if SCALED:  # v's columns times the B^T rows' scales, as lora_expand
        vg = vg * tl.load(bs_ptr + prow * stride_bsr, mask=g_ok, other=0.0)[None, :]
        vu = vu * tl.load(bs_ptr + prow * stride_bsr + stride_bsi, mask=u_ok, other=0.0)[None, :]
    vg = vg.to(cdt)  # rounded as the unfused expand feeds its dot
    vu = vu.to(cdt)
    if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
        vg = vg.to(tl.float32)
        vu = vu.to(tl.float32)
    acc_d = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for j in range(NB):  # a loop: its B and A loads feed dots, which the compiler pipelines
        offs_n = (pid_n * NB + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        io = m_ok[:, None] & n_ok[None, :]
        g_ptrs = gu_ptr + rows_m * stride_gt + offs_n[None, :]
        gate = tl.load(g_ptrs, mask=io, other=0.0)
        up = tl.load(g_ptrs + inter, mask=io, other=0.0)
        b_cols = b_ptr + prow[:, None] * stride_br + offs_n[None, :]
        bg = tl.load(b_cols, mask=g_ok[:, None] & n_ok[None, :], other=0.0)
        bu = tl.load(b_cols + inter, mask=u_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALED:
            bg = bg.to(tl.float32).to(cdt)
            bu = bu.to(tl.float32).to(cdt)
        if UPCAST:
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        g = (gate.to(tl.float32) + tl.dot(vg, bg) * sg).to(cdt).to(tl.float32)
        u = (up.to(tl.float32) + tl.dot(vu, bu) * su).to(cdt).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(cdt).to(tl.float32)
        out = (a * u).to(cdt)
        tl.store(act_ptr + rows_m * stride_at + offs_n[None, :], out, mask=io)
        if SHRINK:  # this column block's share of act @ A_down^T
            ad = tl.load(
                a_ptr + prow[:, None] * stride_ar + offs_n[None, :],
                mask=d_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            if SCALED:
                ad = ad.to(tl.float32).to(cdt)
            x = out
            if UPCAST:
                x = x.to(tl.float32)
                ad = ad.to(tl.float32)
            acc_d += tl.dot(x, tl.trans(ad))
    if SHRINK:  # whole rank tile written (zeros past the rank): the reader loads 16-column groups
        if SCALED:
            acc_d *= tl.load(as_ptr + prow * stride_asr, mask=d_ok, other=0.0)[None, :]
        vd = vd_ptr + pid_n * stride_vdp + rows_m * stride_vdt + offs_r[None, :]
        tl.store(vd, acc_d, mask=(tl.where(m_ok, 1, 0) * has.to(tl.int32) > 0)[:, None])


def act_blocks(inter: int, block_rank: int) -> tuple[int, int, int]:
    """(activation columns a dot, column blocks a program, column groups = the down shrink's partials):
    at most MAX_PARTIALS groups."""
    block_n = 128 if block_rank <= 32 else 64
    blocks = triton.cdiv(inter, block_n)
    nb = triton.cdiv(blocks, MAX_PARTIALS)
    return block_n, nb, triton.cdiv(blocks, nb)


def fold_silu_mul(
    gate_up: torch.Tensor,
    expand: FoldExpand,
    info: BatchInfo,
    rows: torch.Tensor,
    shrink: FoldShrink | None = None,
    check: bool = True,
    pdl: bool = False,
) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) → silu(gate + delta) * (up + delta) [T, I] (a new tensor; gate_up
    is not written). `expand`: the gate/up group (two slices, v of a norm's shrink, with inv); `shrink`:
    the down group, whose v [groups, T, 1, block_rank] (`act_blocks`) it writes at adapter rows. `pdl`:
    launch as a programmatic dependent (the kernel before writes neither tiles nor adapter tables)."""
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    br = info.block_rank
    block_n, nb, groups = act_blocks(inter, br)
    if check:
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
            raise ValueError(f"gate_up must be [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
        check_fold(gate_up, expand.b, expand.v, expand.ranks, info)
        if expand.v.shape[2] != 2 or expand.inv is None or expand.b.shape[1] < 2 * inter:
            raise ValueError("the gate/up expand has two slices over gate_up's columns and a norm's inv")
        if shrink is not None:
            check_fold(gate_up, shrink.a, shrink.v, shrink.ranks, info)
            if shrink.v.shape[0] != groups or shrink.a.shape[1:] != (1, inter):
                raise ValueError(f"the down shrink takes {groups} partials of A rows [.., 1, {inter}]")
    act = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return act
    e, s = expand, shrink
    bs = e.b_scales
    sh = s is not None
    row_blocks = triton.cdiv(T, info.block_m)
    _fold_act_kernel[(info.num_tiles + row_blocks, groups)](
        gate_up, act, e.v, e.inv, e.b, bs if bs is not None else e.b, e.ranks, e.scalings,
        s.a if sh else e.b, s.a_scales if sh and s.a_scales is not None else e.b, s.v if sh else e.v,
        s.ranks if sh else e.ranks, rows, info.meta, T, inter, info.num_tiles, rows.shape[1],
        gate_up.stride(0), act.stride(0), e.v.stride(0), e.v.stride(1), e.v.stride(2), e.b.stride(0),
        bs.stride(0) if bs is not None else 0, bs.stride(1) if bs is not None else 0,
        e.ranks.stride(0), e.ranks.stride(1), e.scalings.stride(0), e.scalings.stride(1),
        s.a.stride(0) if sh else 0, s.a_scales.stride(0) if sh and s.a_scales is not None else 0,
        s.ranks.stride(0) if sh else 0, rows.stride(0),
        s.v.stride(0) if sh else 0, s.v.stride(1) if sh else 0,
        BLOCK_R=br, BLOCK_M=info.block_m, BLOCK_N=block_n, NB=nb, BLOCK_T=tile_block(info.num_tiles),
        SPLITS=e.v.shape[0], META=META_COLS, SHRINK=sh, UPCAST=interpreting(), SCALED=bs is not None,
        PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return act
