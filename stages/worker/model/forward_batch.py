"""The explicit context of one forward pass (token ids, positions, KV addressing, per-sequence extents),
built by the runner from host-side lists and handed to every layer as an argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqExtent:
    """Sequence b's new tokens are rows [q_start, q_start + q_len) of the batch; with them it has
    ctx_len tokens of context in the KV cache (so its first new token is at position ctx_len - q_len)."""

    q_start: int
    q_len: int
    ctx_len: int


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_rows: torch.Tensor  # [T] int64: flat KV-cache row (page * page_size + offset) per token
    page_table: torch.Tensor  # [B, max_pages] int64 (rows padded with 0 past each sequence's pages)
    logits_indices: torch.Tensor  # [B] int64: the last new token of each sequence
    seqs: tuple[SeqExtent, ...]
    # The Triton attention kernel's block plan (`kernels.paged_attention.AttentionPlan`), built once per
    # forward by the runner; None on the torch attention path.
    attn_plan: object | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
