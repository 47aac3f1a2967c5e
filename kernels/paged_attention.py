"""Varlen paged attention (prefill chunks and decodes mixed, one launch per layer): each program takes a
block of (token, query head) rows of one KV-head group, gathers its keys through the page table and
runs an fp32 online softmax, optionally split over the keys (flash-decoding) and merged by a 2nd kernel."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import device_info
from kernels.batch_info import interpreting

META_COLS = 5  # one row per query block: (seq, q_start, q_len, ctx_len, first packed row)
LOG2E = 1.4426950408889634


# Sizes that change with every batch are not specialised on (a 1 or a multiple of 16 would otherwise
# compile another variant of the same kernel): the variants are those of the constexprs alone.
@triton.jit(do_not_specialize=["num_tokens", "stride_pb"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, meta_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, window, num_tokens, num_heads,
    stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_pb, stride_ot,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, META: tl.constexpr,
):  # fmt: skip
    # Grid: (query blocks of all sequences, KV heads, key splits). Row r of a block is token r // GROUP
    # of its sequence and query head kvh * GROUP + r % GROUP: one K/V read serves the whole group.
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = meta_ptr + pid_m * META
    b = tl.load(row).to(tl.int64)
    q_start = tl.load(row + 1)
    q_len = tl.load(row + 2)
    ctx_len = tl.load(row + 3)
    row0 = tl.load(row + 4)
    first = ctx_len - q_len  # position of the sequence's first new token

    r = row0 + tl.arange(0, BLOCK_M)
    tok = r // GROUP
    head = kvh * GROUP + r % GROUP
    m_ok = tok < q_len
    q_pos = first + tok
    t_idx = (q_start + tok).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
        q = q.to(tl.float32)

    # Keys any row of the block may see: [lo, hi), then this program's share of them.
    hi = first + tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1) + 1
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(lo, first + row0 // GROUP - window + 1)
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        page = tl.load(pt_ptr + b * stride_pb + k_pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
        k_row = page * PAGE_SIZE + k_pos % PAGE_SIZE  # [BLOCK_N] flat cache rows
        k = tl.load(k_base + k_row[:, None] * stride_kr + d[None, :], mask=k_ok[:, None], other=0.0)
        v = tl.load(v_base + k_row[:, None] * stride_vr + d[None, :], mask=k_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    col = head[:, None] * HEAD_DIM + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + t_idx[:, None] * stride_ot + col, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None]
        )
    else:  # partials [S, T, H * D] fp32 and their log2-sum-exp [S, T, H]; an empty split writes -inf, 0
        part = split.to(tl.int64) * num_tokens
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_o_ptr + (part + t_idx[:, None]) * stride_ot + col, o, mask=m_ok[:, None])
        tl.store(part_lse_ptr + (part + t_idx) * num_heads + head, lse, mask=m_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, meta_ptr, out_ptr, num_tokens, num_heads, stride_ot,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
    META: tl.constexpr,
):  # fmt: skip
    # Grid: (query blocks, KV heads), the rows of the first kernel. Each split's normalised output is
    # weighted by 2^(lse_s - max lse); split 0 always saw a key (the row's own token or an earlier one).
    row = meta_ptr + tl.program_id(0) * META
    q_start = tl.load(row + 1)
    q_len = tl.load(row + 2)
    r = tl.load(row + 4) + tl.arange(0, BLOCK_M)
    tok = r // GROUP
    head = tl.program_id(1) * GROUP + r % GROUP
    m_ok = tok < q_len
    t_idx = (q_start + tok).to(tl.int64)
    col = head[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + (s * num_tokens + t_idx) * num_heads + head, mask=m_ok, other=0.0)
        m = tl.maximum(m, lse)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        part = s * num_tokens + t_idx
        lse = tl.load(part_lse_ptr + part * num_heads + head, mask=m_ok, other=0.0)
        w = tl.exp2(lse - m)  # [BLOCK_M]; an empty split has lse -inf, weight 0
        o = tl.load(part_o_ptr + part[:, None] * stride_ot + col, mask=m_ok[:, None], other=0.0)
        total += w
        acc += w[:, None] * o
    res = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + t_idx[:, None] * stride_ot + col, res.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


@dataclass(frozen=True)
class AttentionPlan:
    """Host-known sizes of one forward plus the block table the kernel reads (built once per forward,
    shared by every layer). `meta` is device int32 [num_blocks, META_COLS], heaviest blocks first."""

    meta: torch.Tensor = field(repr=False)
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    block_m: int  # packed (token, head) rows per program
    num_splits: int  # programs sharing one block's keys (power of two; 1 = no merge pass)


def decode_block_m(group: int) -> int:
    """Packed rows per program for sequences of `group` rows each (one token's query heads of a group)."""
    return 16 if group <= 16 else 32 if group <= 32 else 64


def plan_blocks(
    q_starts: Sequence[int],
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    block_m: int | None = None,
) -> tuple[np.ndarray, int, int]:
    """The host half of planning: (meta int32 [num_blocks, META_COLS], block_m, keys of the longest
    block). Sequence b's new tokens are rows [q_starts[b], +q_lens[b]) of q; its context has ctx_lens[b]
    tokens, new ones included. Blocks come heaviest first: a shorter tail of the launch."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    qs, ql, cl = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (q_starts, q_lens, ctx_lens))
    if not (qs.size == ql.size == cl.size):
        raise ValueError("q_starts, q_lens and ctx_lens must have one entry per sequence")
    if np.any(ql < 0) or np.any(ql > cl):
        raise ValueError("every sequence needs 0 <= q_len <= ctx_len")
    rows = ql * group  # packed (token, head) rows per sequence
    if block_m is None:
        block_m = decode_block_m(int(rows.max()) if rows.size else 0)
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be 16, 32, 64 or 128, got {block_m}")
    nb = (rows + block_m - 1) // block_m
    seq = np.repeat(np.arange(qs.size), nb)
    row0 = (np.arange(seq.size) - np.repeat(np.cumsum(nb) - nb, nb)) * block_m
    hi = cl[seq] - ql[seq] + np.minimum((row0 + block_m - 1) // group, ql[seq] - 1) + 1  # keys seen
    order = np.argsort(-hi, kind="stable")
    meta = np.stack([seq, qs[seq], ql[seq], cl[seq], row0], axis=1)[order].astype(np.int32)
    return meta, block_m, int(hi.max()) if hi.size else 0


def choose_splits(
    num_blocks: int,
    num_kv_heads: int,
    most_keys: int,
    device: torch.device | str,
    min_split_keys: int = 256,
    max_splits: int = 16,
) -> int:
    """Key splits per block (a power of two): only when the blocks alone would leave the GPU mostly
    idle and the longest block has enough keys to share."""
    programs, splits = max(1, num_blocks * num_kv_heads), 1
    sms = device_info.num_sms(torch.device(device))
    while (
        splits * 2 <= max_splits and programs * splits < 2 * sms and most_keys >= 2 * splits * min_split_keys
    ):
        splits *= 2
    return splits


def split_key_counts(max_keys: int, min_split_keys: int = 256) -> list[int]:
    """Key counts up to `max_keys` that reach every answer `choose_splits` can give (it doubles the
    splits at each doubling of the keys from 2 x min_split_keys on, and never splits below that)."""
    doublings = (2 * min_split_keys << i for i in range(max_keys.bit_length()))
    return sorted({1, max_keys, *(k for k in doublings if k < max_keys)})


def plan_attention(
    q_starts: Sequence[int],
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device | str,
    block_m: int | None = None,
    num_splits: int | None = None,
    min_split_keys: int = 256,
    max_splits: int = 16,
) -> AttentionPlan:
    """Plan query blocks on the host (`plan_blocks`) and issue the one non-blocking host-to-device copy.
    Keys are split across programs only when the blocks alone would leave the GPU mostly idle."""
    device = torch.device(device)
    meta, block_m, most_keys = plan_blocks(
        q_starts, q_lens, ctx_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, block_m=block_m
    )
    if num_splits is None:
        num_splits = choose_splits(meta.shape[0], num_kv_heads, most_keys, device, min_split_keys, max_splits)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    host = torch.from_numpy(meta)  # [num_blocks, META_COLS]
    if device.type == "cuda":
        host = host.pin_memory()
    qs, ql = np.asarray(q_starts, dtype=np.int64), np.asarray(q_lens, dtype=np.int64)
    return AttentionPlan(
        meta=host.to(device, non_blocking=True),
        num_tokens=int((qs + ql).max()) if qs.size else 0,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_m=block_m,
        num_splits=num_splits,
    )


@dataclass(frozen=True)
class AttentionConfig:
    block_n: int  # keys per loop step
    num_warps: int
    num_stages: int


def attention_config(plan: AttentionPlan, head_dim: int) -> AttentionConfig:
    if plan.block_m <= 16:  # decode-like: few rows, so wide key steps keep more loads in flight
        return AttentionConfig(block_n=128 if head_dim <= 64 else 64, num_warps=4, num_stages=2)
    block_n = 64 if head_dim <= 128 else 32
    return AttentionConfig(block_n=block_n, num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    plan: AttentionPlan,
    *,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """q [T, H, D] (rotated); k_cache, v_cache [num_pages * page_size, KVH, D]; page_table [B, max_pages]
    int64/int32. Causal (optionally sliding-window) attention of each planned sequence's new tokens over
    its cached context. Returns out [T, H * D] in q's dtype; rows of tokens in no sequence are untouched."""
    if q.dim() != 3 or k_cache.dim() != 3 or page_table.dim() != 2:
        raise ValueError(
            f"expected q [T, H, D], caches [rows, KVH, D], page_table [B, P]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(page_table.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(f"K/V caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit D={head_dim}")
    num_kv_heads = k_cache.shape[1]
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    if (plan.num_heads, plan.num_kv_heads) != (num_heads, num_kv_heads):
        raise ValueError(
            f"plan was made for {plan.num_heads} heads / {plan.num_kv_heads} KV heads, "
            f"tensors have {num_heads} / {num_kv_heads}"
        )
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, K and V caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if page_table.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"page_table must be int64 or int32, got {page_table.dtype}")
    if plan.meta.dtype != torch.int32 or plan.meta.dim() != 2 or plan.meta.shape[1] != META_COLS:
        raise ValueError(
            f"plan.meta must be int32 [blocks, {META_COLS}], got {plan.meta.dtype} {tuple(plan.meta.shape)}"
        )
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or page_table.stride(1) != 1:
        raise ValueError("q, the K/V caches and page_table must be contiguous in their last dim")
    if not (q.device == k_cache.device == v_cache.device == page_table.device == plan.meta.device):
        raise ValueError("q, the caches, page_table and the plan must be on one device")
    if num_tokens < plan.num_tokens:
        raise ValueError(f"q has {num_tokens} tokens but the plan reaches token {plan.num_tokens}")
    if k_cache.shape[0] % page_size:
        raise ValueError(f"cache rows {k_cache.shape[0]} are not a multiple of page_size={page_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    shape = (num_tokens, num_heads * head_dim)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)  # [T, H * D]
    elif tuple(out.shape) != shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {q.dtype} {shape}, got {out.dtype} {tuple(out.shape)}")
    num_blocks, splits = plan.meta.shape[0], plan.num_splits
    if num_blocks == 0:
        return out
    cfg = config or attention_config(plan, head_dim)
    if splits > 1:
        part_o = torch.empty((splits, *shape), dtype=torch.float32, device=q.device)  # [S, T, H * D]
        part_lse = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    fp32 = q.dtype == torch.float32
    _paged_attention_kernel[(num_blocks, num_kv_heads, splits)](
        q, k_cache, v_cache, page_table, plan.meta, out, part_o, part_lse,
        scale * LOG2E, sliding_window or 0, num_tokens, num_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), page_table.stride(0), out.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, NUM_SPLITS=splits,
        HAS_WINDOW=sliding_window is not None, UPCAST=interpreting(),
        PRECISION="ieee" if fp32 or interpreting() else "tf32", META=META_COLS,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(num_blocks, num_kv_heads)](
            part_o, part_lse, plan.meta, out, num_tokens, num_heads, out.stride(0),
            GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=plan.block_m, NUM_SPLITS=splits,
            META=META_COLS, num_warps=4,
        )  # fmt: skip
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    extents: Sequence[tuple[int, int, int]],
    *,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time in q's dtype (fp32 math): extents are (q_start, q_len,
    ctx_len) per sequence. Returns [T, H * D]; rows of tokens in no sequence are zero."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
    for b, (q_start, q_len, ctx_len) in enumerate(extents):
        pos = torch.arange(ctx_len, device=q.device)
        rows = page_table[b, pos // page_size].long() * page_size + pos % page_size  # [ctx]
        k = k_cache[rows].float().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v_cache[rows].float().repeat_interleave(group, dim=1)
        qs = q[q_start : q_start + q_len].float()  # [n, H, D]
        s = torch.einsum("nhd,chd->hnc", qs, k) * scale  # [H, n, ctx]
        q_pos = pos[ctx_len - q_len :, None]
        seen = pos[None, :] <= q_pos
        if sliding_window is not None:
            seen &= pos[None, :] > q_pos - sliding_window
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        out[q_start : q_start + q_len] = torch.einsum("hnc,chd->nhd", p, v)
    return out.reshape(num_tokens, num_heads * head_dim).to(q.dtype)
