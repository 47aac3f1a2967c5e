"""One sequence's share of a forward step, as the executor hands it to the runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeqInput:
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # tokens of this sequence already in the KV cache
    page_ids: list[int]  # all its pages, enough for start_pos + len(token_ids)
    slot: int  # adapter id in the pool, -1 for none
