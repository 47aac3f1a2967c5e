"""The pieces of the LoRA kernels that more than one kernel runs: a shrink program's columns and its K loop
(`lora_shrink`, the shrink items of `lora_fused`), an expand program's slice, pointers and rank chunks
(`lora_expand`, its items in `lora_fused`, and `lora_expand_act`'s split sum and scales). Triton inlines
them into each kernel, so every kernel computes exactly what its own copy of the lines did."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_of(meta_ptr, pid_t, META: tl.constexpr):
    """Token tile pid_t's rows [start, end) and its adapter id (int64: its row of the ranks, scalings and
    row tables), from the tile's row of the batch metadata."""
    row = meta_ptr + (pid_t + 1) * META
    start = tl.load(row)
    end = tl.load(row + 1)
    slot = tl.load(row + 2).to(tl.int64)
    return start, end, slot


@triton.jit
def shrink_columns(
    ranks_ptr, rows_ptr, slot, pid_n, table_width, stride_rs, stride_ri, stride_ts,
    NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Column block pid_n of the flattened (slice, rank) space of adapter `slot`: each column's slice and
    rank row, whether its slice is in the group, its pool row, and whether it is below the slice's rank
    (only those A rows are read). Reads only the adapter tables (a dependent launch's constant data)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    sl = cols // BLOCK_R
    rk = cols % BLOCK_R
    in_group = sl < NUM_SLICES
    r = tl.load(ranks_ptr + slot * stride_rs + sl * stride_ri, mask=in_group, other=0)
    # Pool row of each column's rank row. Masked by the table width, not the rank, so this gather is in
    # flight together with the rank load; entries past the rank are loaded but never dereferenced.
    prow = tl.load(rows_ptr + slot * stride_ts + rk, mask=in_group & (rk < table_width), other=0)
    r = tl.minimum(r, table_width)  # a rank past the table would index the next adapter's entries
    col_ok = in_group & (rk < r)  # rows past an adapter's real rank hold stale data: never read
    return sl, rk, in_group, prow, col_ok


@triton.jit
def shrink_dot(
    x_ptr, a_ptr, as_ptr, offs_m, m_ok, k0, K, k_per_split, sl, prow, col_ok,
    stride_xt, stride_ar, stride_ai, stride_asr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N]: x[offs_m, k0 : k0 + k_per_split] @ A^T over the columns' pool rows (of
    `shrink_columns`), zero in masked rows and columns; an 8-bit pool's columns times their rows' scales."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    a_rows = prow.to(tl.int64) * stride_ar + sl * stride_ai  # [BLOCK_N] int64: pools pass 2^31 elements
    a_ptrs = a_ptr + a_rows[:, None] + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        k_ok = offs_k < K
        xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        at = tl.load(a_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if SCALED:  # e4m3 and int8 values are exact in fp32 and in x's dtype
            at = at.to(tl.float32).to(xt.dtype)
        if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, tl.trans(at))
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        offs_k += BLOCK_K
    if SCALED:  # column (slice, k) times the scale of A_slice's rank row k
        acc *= tl.load(as_ptr + prow.to(tl.int64) * stride_asr + sl, mask=col_ok, other=0.0)[None, :]
    return acc


@triton.jit
def slice_block(pid_n, d0, d1, d2, o0, o1, o2, BLOCK_N: tl.constexpr):
    """The slice that expand column block pid_n belongs to (absent slices have width 0, so no block maps
    there; a block never straddles two), the block's first column in it, the slice's width and its
    offset in the output."""
    nb0 = tl.cdiv(d0, BLOCK_N)
    nb1 = nb0 + tl.cdiv(d1, BLOCK_N)
    s = (pid_n >= nb0).to(tl.int32) + (pid_n >= nb1).to(tl.int32)
    n0 = (pid_n - tl.where(s == 0, 0, tl.where(s == 1, nb0, nb1))) * BLOCK_N
    width = tl.where(s == 0, d0, tl.where(s == 1, d1, d2))
    off = tl.where(s == 0, o0, tl.where(s == 1, o1, o2))
    return s, n0, width, off


@triton.jit
def expand_block(
    out_ptr, v_ptr, b_ptr, bs_ptr, offs_m, m_ok, s, n0, width, off, offs_r, stride_ot, stride_vt,
    stride_vi, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """An expand program's pointers (of `slice_block`'s block): out's block and its mask, which columns
    are in the slice, B^T's columns (each rank chunk adds its gathered rows' offsets), the slice's column
    of B^T scales (8-bit pools) and v's rows at the slice's first rank column."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + (off + offs_n)[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    b_cols = b_ptr + (off + offs_n)[None, :]  # [1, BLOCK_N]
    bs_col = bs_ptr + s
    v_ptrs = v_ptr + offs_m[:, None].to(tl.int64) * stride_vt + s * stride_vi + offs_r[None, :]
    return o_ptrs, o_mask, n_ok, b_cols, bs_col, v_ptrs


@triton.jit
def split_sum(v_ptrs, mask, stride_vp, NUM_SPLITS: tl.constexpr, CACHE: tl.constexpr):
    """v summed over the shrink's split-K partials (fp32), zero where masked. CACHE: the loads' cache
    modifier, ".cg" (past L1) where other programs of the same launch wrote v, else ""."""
    v = tl.load(v_ptrs, mask=mask, other=0.0, cache_modifier=CACHE)
    for p in tl.static_range(1, NUM_SPLITS):
        v += tl.load(v_ptrs + p * stride_vp, mask=mask, other=0.0, cache_modifier=CACHE)
    return v


@triton.jit
def row_gather(t_ptrs, k, offs_r, table_width):
    """Pool rows of rank rows k..k+BLOCK_K (int64). Masked by the table width only, so that the first
    chunk's gather can be issued before the rank is known; rows past the rank are never dereferenced."""
    return tl.load(t_ptrs + k, mask=(k + offs_r) < table_width, other=0).to(tl.int64)


@triton.jit
def b_chunk(b_cols, prow, k, r, n_ok, offs_r, stride_br):
    """B[prow, :] for rank rows k..k+BLOCK_K (the chunk's pool rows), zero past the rank."""
    k_ok = (k + offs_r) < r
    return tl.load(b_cols + (prow * stride_br)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def b_scale_chunk(bs_ptr, prow, k, r, offs_r, stride_bsr, SCALED: tl.constexpr):
    """The scales of the chunk's B^T rows ([BLOCK_K] fp32, zero past the rank) of an 8-bit pool; zeros
    else (never read: one return of one type either way, as compiled code needs)."""
    if SCALED:
        scales = tl.load(bs_ptr + prow * stride_bsr, mask=(k + offs_r) < r, other=0.0)
    else:
        scales = (offs_r * 0).to(tl.float32)
    return scales


@triton.jit
def b_rows(
    t_ptrs, b_cols, bs_col, k, r, n_ok, offs_r, table_width, stride_br, stride_bsr, SCALED: tl.constexpr
):
    """Rank chunk k..k+BLOCK_K of the adapter's B^T rows ([BLOCK_K, BLOCK_N], zero past the rank),
    gathered through its row table entries `t_ptrs`, and their scales (`b_scale_chunk`)."""
    prow = row_gather(t_ptrs, k, offs_r, table_width)
    bt = b_chunk(b_cols, prow, k, r, n_ok, offs_r, stride_br)
    bs = b_scale_chunk(bs_col, prow, k, r, offs_r, stride_bsr, SCALED)
    return bt, bs


@triton.jit
def v_chunk(v_ptrs, k, r16, m_ok, offs_r, stride_vp, NUM_SPLITS: tl.constexpr, CACHE: tl.constexpr):
    """v[:, k:k+BLOCK_K] summed over the split-K partials (fp32), zero in masked rows and past r16 (the
    shrink writes whole 16-column groups, zeros past the rank, so no finer mask is needed)."""
    mask = m_ok[:, None] & ((k + offs_r) < r16)[None, :]
    return split_sum(v_ptrs + k, mask, stride_vp, NUM_SPLITS, CACHE)


@triton.jit
def chunk_dot(v, bt, bs, UPCAST: tl.constexpr, CDT: tl.constexpr):
    """v @ bt for a chunk's [BLOCK_K, BLOCK_N] B rows; with `bs` scales of 8-bit rows (CDT: the output's
    dtype), v's column j times bs[j] and bt in CDT."""
    if bt.dtype != CDT:  # 8-bit rows: exact in fp32 and in CDT
        v = v * bs[None, :]
        bt = bt.to(tl.float32).to(CDT)
    v = v.to(bt.dtype)  # same rounding of v as a plain dtype matmul chain
    if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
        v = v.to(tl.float32)
        bt = bt.to(tl.float32)
    return tl.dot(v, bt)
