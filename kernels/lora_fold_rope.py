"""Rotary embedding and the K/V cache write with the q/k/v LoRA expand folded in, one launch: each head of
the fused QKV output gets its token's adapter delta (scaling * v @ B over the head's columns, rounded to
the model dtype as `lora_expand` stores it) before it is rotated (q, k) or written (v), as
`kernels/rotary.py` rotates and writes. v comes from the shrink folded into the layer's input norm, its
partials summed and scaled by each row's 1 / rms here (`kernels/lora_fold_parts.py`).

Grid: (token tiles + blocks of rows, q heads + 2 * kv heads): a program takes one head of a tile's rows
(one adapter: its delta one dot, its B rows read once a tile), or of the rows of a block that no tile
holds (base-only and padding rows, rotated as they are)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels.batch_info import META_COLS, BatchInfo, interpreting, next_pow2
from kernels.lora_fold_parts import FoldExpand, b_tile, check_fold, row_adapter, tile_block, tile_rows
from kernels.lora_parts import split_sum


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2):
    """The half-split rotation of one head's halves (fp32 in), rounded as torch rounds it in x1's dtype."""
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    a1 = (x1f * c1).to(dt).to(tl.float32)
    b1 = (-x2f * s1).to(dt).to(tl.float32)
    a2 = (x2f * c2).to(dt).to(tl.float32)
    b2 = (x1f * s2).to(dt).to(tl.float32)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


# The token and tile counts change per batch: specialised on (1, multiples of 16), they would make
# variants per batch size that no warm-up launch names.
@triton.jit(do_not_specialize=["T", "n_grid"])
def _fold_rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, kvrows_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    v_ptr, inv_ptr, b_ptr, bs_ptr, ranks_ptr, scal_ptr, rows_ptr, meta_ptr,
    T, n_grid, table_width, stride_qkv, stride_cs, stride_kr, stride_vr,
    stride_vp, stride_vt, stride_vi, stride_br, stride_bsr, stride_bsi, stride_rs, stride_ri, stride_ss,
    stride_si, stride_ts,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr, META: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Grid: (tiles + blocks of BLOCK_M rows, q heads + 2 * kv heads), rows as `tile_rows` gives them.
    # PDL: this kernel may start while the QKV GEMM before it runs. Before its wait it reads only the
    # step's constant data: the batch tiles, the adapter tables and B rows, the K/V rows, cos and sin;
    # qkv and v after it. Every program passes the wait: its completion implies the GEMM's.
    pid_b = tl.program_id(0)
    hh = tl.program_id(1)
    offs_m, m_ok, slot = tile_rows(meta_ptr, pid_b, n_grid, T, BLOCK_M, BLOCK_T, META)
    if tl.max(m_ok.to(tl.int32), axis=0) == 0:
        if PDL:
            gdc_wait()
        return
    s = (hh >= NUM_HEADS).to(tl.int32) + (hh >= NUM_HEADS + NUM_KV_HEADS).to(tl.int32)  # q, k or v
    r, scale, offs_r, r_ok, prow = row_adapter(
        ranks_ptr, scal_ptr, rows_ptr, slot, s, table_width, stride_rs, stride_ri, stride_ss, stride_si,
        stride_ts, BLOCK_R,
    )  # fmt: skip
    cdt = q_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    col = hh * HEAD_DIM + d  # the head's first half in the fused output and in B^T's columns
    b1 = b_tile(b_ptr, prow, r_ok, col, d_ok, stride_br, SCALED, cdt).to(cdt)  # [BLOCK_R, BLOCK_D]
    b2 = b_tile(b_ptr, prow, r_ok, col + HALF, d_ok, stride_br, SCALED, cdt).to(cdt)
    rows_m = offs_m.to(tl.int64)
    io = m_ok[:, None] & d_ok[None, :]
    kv_row = tl.load(kvrows_ptr + rows_m, mask=m_ok, other=0).to(tl.int64)
    cs = rows_m[:, None] * stride_cs + d[None, :]
    c1 = tl.load(cos_ptr + cs, mask=io, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=io, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=io, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=io, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    # v of the tile's rows (a norm's shrink: times each row's 1 / rms), rounded as the expand feeds its dot
    v_mask = m_ok[:, None] & r_ok[None, :]
    v_ptrs = v_ptr + rows_m[:, None] * stride_vt + s * stride_vi + offs_r[None, :]
    v = split_sum(v_ptrs, v_mask, stride_vp, SPLITS, "")
    v = v * tl.load(inv_ptr + rows_m, mask=m_ok, other=0.0)[:, None]
    if SCALED:  # v's columns times the B^T rows' scales, as lora_expand
        v = v * tl.load(bs_ptr + prow * stride_bsr + s * stride_bsi, mask=r_ok, other=0.0)[None, :]
    v = v.to(cdt)
    if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
        v, b1, b2 = v.to(tl.float32), b1.to(tl.float32), b2.to(tl.float32)
    src = qkv_ptr + rows_m[:, None] * stride_qkv + col[None, :]
    x1 = tl.load(src, mask=io, other=0.0)
    x2 = tl.load(src + HALF, mask=io, other=0.0)
    x1 = (x1.to(tl.float32) + tl.dot(v, b1) * scale).to(x1.dtype)
    x2 = (x2.to(tl.float32) + tl.dot(v, b2) * scale).to(x2.dtype)
    if hh < NUM_HEADS + NUM_KV_HEADS:
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2)
        if hh < NUM_HEADS:  # (each store in its own branch: the cache may have another dtype than q)
            q_dst = q_ptr + rows_m[:, None] * (NUM_HEADS * HEAD_DIM) + hh * HEAD_DIM + d[None, :]
            tl.store(q_dst, o1, mask=io)
            tl.store(q_dst + HALF, o2, mask=io)
        else:
            k_dst = k_cache_ptr + kv_row[:, None] * stride_kr + (hh - NUM_HEADS) * HEAD_DIM + d[None, :]
            tl.store(k_dst, o1, mask=io)
            tl.store(k_dst + HALF, o2, mask=io)
    else:
        head = hh - NUM_HEADS - NUM_KV_HEADS
        v_dst = v_cache_ptr + kv_row[:, None] * stride_vr + head * HEAD_DIM + d[None, :]
        tl.store(v_dst, x1, mask=io)
        tl.store(v_dst + HALF, x2, mask=io)


def fold_rope_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    expand: FoldExpand,
    info: BatchInfo,
    rows: torch.Tensor,
    check: bool = True,
    pdl: bool = False,
) -> torch.Tensor:
    """`kernels.rotary.rope_kv_write` of qkv + the q/k/v group's LoRA delta (`expand`: its three slices,
    v from a norm's shrink, so with `inv`); qkv is not written. Returns q [T, H, D] (a new tensor).
    `pdl`: launch as a programmatic dependent (the kernel before writes none of what is read before
    the wait)."""
    T = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if check:
        if head_dim % 2 or qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(
                f"qkv {tuple(qkv.shape)} is not [T, ({num_heads} + 2 * {num_kv_heads}) * even D]"
            )
        for cache in (k_cache, v_cache):
            if (
                cache.shape[1:] != (num_kv_heads, head_dim)
                or cache.stride(2) != 1
                or cache.stride(1) != head_dim
            ):
                raise ValueError(
                    f"a K/V cache {tuple(cache.shape)} is not [rows, {num_kv_heads}, {head_dim}]"
                )
        check_fold(qkv, expand.b, expand.v, expand.ranks, info)
        if expand.v.shape[2] != 3 or expand.inv is None or expand.b.shape[1] < qkv.shape[1]:
            raise ValueError("the q/k/v expand has three slices over qkv's columns and a norm's inv")
    cos2, sin2 = cos.reshape(T, head_dim), sin.reshape(T, head_dim)
    if check and (cos2.stride() != sin2.stride() or cos2.stride(-1) != 1):
        raise ValueError("rotary cos and sin must share one layout with contiguous rows")
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    e, bs = expand, expand.b_scales
    grid = (info.num_tiles + triton.cdiv(T, info.block_m), num_heads + 2 * num_kv_heads)
    _fold_rope_kernel[grid](
        qkv, cos2, sin2, kv_rows, q, k_cache, v_cache, e.v, e.inv, e.b, bs if bs is not None else e.b,
        e.ranks, e.scalings, rows, info.meta, T, info.num_tiles, rows.shape[1],
        qkv.stride(0), cos2.stride(0), k_cache.stride(0), v_cache.stride(0),
        e.v.stride(0), e.v.stride(1), e.v.stride(2), e.b.stride(0),
        bs.stride(0) if bs is not None else 0, bs.stride(1) if bs is not None else 0,
        e.ranks.stride(0), e.ranks.stride(1), e.scalings.stride(0), e.scalings.stride(1), rows.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        BLOCK_D=max(16, next_pow2(head_dim // 2)), BLOCK_R=info.block_rank, BLOCK_M=info.block_m,
        BLOCK_T=tile_block(info.num_tiles), SPLITS=e.v.shape[0], META=META_COLS, UPCAST=interpreting(),
        SCALED=bs is not None, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return q
