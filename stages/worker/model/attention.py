"""Attention over the paged KV cache, chosen once by configuration (`attention_backend`): the Triton
varlen kernel (`kernels/paged_attention.py`), the default on CUDA, or the plain torch loop below, the CPU
default and the reference. The Triton path reads a block plan the runner builds once per forward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from stages.worker.model.forward_batch import ForwardBatch, SeqExtent
from stages.worker.model.kv_cache import KVCache

BACKENDS = ("triton", "torch")

# (q [T, H, D] rotated, kv, layer, fb, scale, sliding_window) -> [T, H * D]
Attention = Callable[[torch.Tensor, KVCache, int, ForwardBatch, float, int | None], torch.Tensor]


def resolve_backend(name: str | None, device: torch.device) -> str:
    """`name`, or the device's default: Triton on CUDA, the torch loop elsewhere."""
    if name is None:
        return "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose one of {', '.join(BACKENDS)})")
    return name


def attention_fn(backend: str) -> Attention:
    return triton_paged_attention if backend == "triton" else torch_paged_attention


def plan_for(backend: str, seqs: Sequence[SeqExtent], num_heads: int, num_kv_heads: int, device):
    """The Triton kernel's block plan for one forward (one host-to-device copy, shared by every layer);
    None for the torch loop, which reads the extents themselves."""
    if backend != "triton":
        return None
    from kernels import paged_attention as kernel  # here: triton is only a dependency on Linux

    return kernel.plan_attention(
        [s.q_start for s in seqs],
        [s.q_len for s in seqs],
        [s.ctx_len for s in seqs],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        device=device,
    )


def triton_paged_attention(
    q: torch.Tensor, kv: KVCache, layer: int, fb: ForwardBatch, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """One kernel launch for the whole batch over `fb.attn_plan`; no host-device synchronisation."""
    from kernels import paged_attention as kernel

    plan = fb.attn_plan
    if plan is None:
        raise ValueError("the Triton attention path needs the forward's block plan (ForwardBatch.attn_plan)")
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
