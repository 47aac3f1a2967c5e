"""One sequence's share of a forward step, as the executor hands it to the runner, and the placeholder
ids of tokens that an overlapped step sampled but the host has not read yet (resolved on the device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqInput:
    # the tokens to compute this step; a negative id -1 - r stands for row r of the sampled tokens of the
    # step still in flight (`pending` of ModelRunner.execute), read on the device, never on the host
    token_ids: list[int]
    start_pos: int  # tokens of this sequence already in the KV cache
    page_ids: list[int]  # all its pages, enough for start_pos + len(token_ids)
    slot: int  # adapter id in the pool, -1 for none


def fill_pending(ids: torch.Tensor, pending: torch.Tensor | None) -> None:
    """Replace the placeholder ids (-1 - r) in the device buffer `ids` with row r of `pending` (the
    in-flight step's sampled tokens, [B] int64 on the same device), in place: stream-ordered device ops
    of fixed shape, no host read, so a CUDA graph that reads `ids` afterwards sees real tokens."""
    if pending is None:
        return
    rows = (-1 - ids).clamp_(min=0)  # [T]; real ids (>= 0) map to row 0, which `where` ignores
    ids.copy_(torch.where(ids < 0, pending[rows], ids))


def has_placeholders(seqs: list[SeqInput]) -> bool:
    return any(min(s.token_ids) < 0 for s in seqs)
