"""Rotary embedding of q and k and the K/V cache write, one launch per layer: each program takes one
token's row of the fused QKV output, rotates its query heads into a contiguous q [T, H, D], rotates its
key heads and stores them and its value heads at the token's cache row. The half-split rotation of HF
Llama (`x * cos + rotate_half(x) * sin`), rounded as torch rounds it in the model dtype: each product,
then their sum. Replaces the dozen launches of the torch form (negate, concatenate, three products and
sums for q and for k, two index copies)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.batch_info import next_pow2


@triton.jit
def _rotate_heads(src, dst, c1, c2, s1, s2, heads, d, head_ok, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rotate `heads` [BLOCK_H] heads of HEAD_DIM at src into dst (both head-major, contiguous heads)."""
    ok = head_ok[:, None] & (d[None, :] < HALF)
    lo = heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(src + lo, mask=ok, other=0.0)
    x2 = tl.load(src + lo + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    a1 = (x1f * c1[None, :]).to(dt).to(tl.float32)
    b1 = (-x2f * s1[None, :]).to(dt).to(tl.float32)
    a2 = (x2f * c2[None, :]).to(dt).to(tl.float32)
    b2 = (x1f * s2[None, :]).to(dt).to(tl.float32)
    tl.store(dst + lo, (a1 + b1).to(dt), mask=ok)
    tl.store(dst + lo + HALF, (a2 + b2).to(dt), mask=ok)


@triton.jit
def _rope_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qkv,
    stride_cs,
    stride_kr,
    stride_vr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Grid: (tokens,).
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    cs = t * stride_cs
    c1 = tl.load(cos_ptr + cs + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    src = qkv_ptr + t * stride_qkv
    heads = tl.arange(0, BLOCK_H)
    _rotate_heads(src, q_ptr + t * (NUM_HEADS * HEAD_DIM), c1, c2, s1, s2, heads, d, heads < NUM_HEADS,
                  HALF, HEAD_DIM)  # fmt: skip
    row = tl.load(rows_ptr + t).to(tl.int64)
    kv_heads = tl.arange(0, BLOCK_KV)
    k_src = src + NUM_HEADS * HEAD_DIM
    _rotate_heads(k_src, k_cache_ptr + row * stride_kr, c1, c2, s1, s2, kv_heads, d, kv_heads < NUM_KV_HEADS,
                  HALF, HEAD_DIM)  # fmt: skip
    # V: copied as it is, both halves of each head.
    v_ok = (kv_heads < NUM_KV_HEADS)[:, None] & d_ok[None, :]
    lo = kv_heads[:, None] * HEAD_DIM + d[None, :]
    v_src = k_src + NUM_KV_HEADS * HEAD_DIM
    v_dst = v_cache_ptr + row * stride_vr
    tl.store(v_dst + lo, tl.load(v_src + lo, mask=v_ok), mask=v_ok)
    tl.store(v_dst + lo + HALF, tl.load(v_src + lo + HALF, mask=v_ok), mask=v_ok)


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) * D] (rows contiguous), cos/sin [T, 1, D] or [T, D] of each token's position,
    rows [T] int64 cache rows, k_cache/v_cache [R, KVH, D] (one layer). Writes the rotated keys and the
    values at `rows`; returns the rotated queries [T, H, D] (a new contiguous tensor)."""
    T = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
    if qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} is not [T, ({num_heads} + 2 * {num_kv_heads}) * {head_dim}] "
            "with contiguous rows"
        )
    cos2, sin2 = cos.reshape(T, head_dim), sin.reshape(T, head_dim)
    if cos2.stride() != sin2.stride() or cos2.stride(-1) != 1:
        raise ValueError("rotary cos and sin must share one layout with contiguous rows")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.shape[1:] != (num_kv_heads, head_dim) or cache.stride(2) != 1 or cache.stride(1) != head_dim:
            want = f"[rows, {num_kv_heads}, {head_dim}]"
            raise ValueError(f"{name} {tuple(cache.shape)} is not {want} with dense rows")
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    half = head_dim // 2
    _rope_kv_kernel[(T,)](
        qkv, cos2, sin2, rows, q, k_cache, v_cache,
        qkv.stride(0), cos2.stride(0), k_cache.stride(0), v_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_H=next_pow2(num_heads), BLOCK_KV=next_pow2(num_kv_heads), BLOCK_D=next_pow2(half),
        num_warps=4,
    )  # fmt: skip
    return q
