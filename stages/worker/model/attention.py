"""Attention over the paged KV cache. One entry point, `paged_attention`, so a fused GPU kernel can
replace the plain torch path without touching the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.worker.model.forward_batch import ForwardBatch
from stages.worker.model.kv_cache import KVCache


def paged_attention(
    q: torch.Tensor,  # [T, H, D], already rotated
    kv: KVCache,
    layer: int,
    fb: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context. Returns [T, H * D]."""
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
