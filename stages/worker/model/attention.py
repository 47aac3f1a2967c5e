"""Attention over the paged KV cache. One entry point, `paged_attention`: the Triton varlen kernel on CUDA
(`kernels/paged_attention.py`), the plain torch loop below on the CPU and as the reference."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from stages.worker.model.forward_batch import ForwardBatch
from stages.worker.model.kv_cache import KVCache

# None: the Triton kernel for CUDA tensors unless LORAPIPE_ATTENTION=torch; True/False force one path
# (True also runs the kernel on CPU tensors, under TRITON_INTERPRET=1: for tests).
USE_TRITON: bool | None = None


def use_triton(q: torch.Tensor) -> bool:
    if USE_TRITON is not None:
        return USE_TRITON
    return q.is_cuda and os.environ.get("LORAPIPE_ATTENTION", "").lower() != "torch"


def plan_key(num_heads: int, num_kv_heads: int) -> str:
    """Where a forward's attention block plan lives in `ForwardBatch.derived` (made once, read by all)."""
    return f"paged_attention_plan:{num_heads}:{num_kv_heads}"


def paged_attention(
    q: torch.Tensor,  # [T, H, D], already rotated
    kv: KVCache,
    layer: int,
    fb: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context. Returns [T, H * D]."""
    if use_triton(q):
        return triton_paged_attention(q, kv, layer, fb, scale, sliding_window)
    return torch_paged_attention(q, kv, layer, fb, scale, sliding_window)


def triton_paged_attention(
    q: torch.Tensor, kv: KVCache, layer: int, fb: ForwardBatch, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """One kernel launch for the whole batch; no host-device synchronisation. The block plan is built on
    the first layer's call (one host-to-device copy) and kept in `fb.derived` for the other layers."""
    from kernels import paged_attention as kernel  # here: triton is only a dependency on Linux

    num_heads, num_kv_heads = q.shape[1], kv.k.shape[2]
    key = plan_key(num_heads, num_kv_heads)
    plan = fb.derived.get(key)
    if plan is None:
        plan = fb.derived[key] = kernel.plan_attention(
            [s.q_start for s in fb.seqs],
            [s.q_len for s in fb.seqs],
            [s.ctx_len for s in fb.seqs],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            device=q.device,
        )
    return kernel.paged_attention(
        q,
        kv.k[layer],
        kv.v[layer],
        fb.page_table,
        plan,
        page_size=kv.page_size,
        scale=scale,
        sliding_window=sliding_window,
    )


def torch_paged_attention(
    q: torch.Tensor, kv: KVCache, layer: int, fb: ForwardBatch, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """The plain path: one SDPA call per sequence over its gathered context. Returns [T, H * D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads * head_dim), dtype=q.dtype, device=q.device)
    k_rows, v_rows = kv.k[layer], kv.v[layer]  # [pages * page_size, KVH, D]
    page_size = kv.page_size
    offsets = torch.arange(page_size, device=q.device)
    for b, s in enumerate(fb.seqs):
        num_pages = (s.ctx_len + page_size - 1) // page_size
        rows = (fb.page_table[b, :num_pages, None] * page_size + offsets).flatten()[: s.ctx_len]  # [ctx]
        k = k_rows[rows].transpose(0, 1)  # [KVH, ctx, D]
        v = v_rows[rows].transpose(0, 1)
        qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [H, n, D]
        first = s.ctx_len - s.q_len
        if sliding_window is None and first == 0:
            mask, causal = None, True
        else:
            q_pos = torch.arange(first, s.ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(s.ctx_len, device=q.device)[None, :]
            mask = k_pos <= q_pos  # [n, ctx]
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            causal = False
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )  # [H, n, D]
        out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1).reshape(s.q_len, num_heads * head_dim)
    return out
