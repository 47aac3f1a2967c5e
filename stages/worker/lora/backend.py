"""The LoRA backend interface: `prepare` once per forward with the batch's adapter segments, then
`apply` per fused projection to add every token's adapter delta in place."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from runtime.common.lora_layout import GroupLayout
from stages.worker.lora.pool import LoraPool

# LoRA token tile of every fixed-shape (graphed) batch, decode and step graphs, at every bucket. A graph
# serves every adapter mix, and a step with many adapters has mostly short runs (one-token decodes), each
# a tile of its own: at 64 such a tile wastes 63 rows of work. On an H100 (benchmarks/bench_lora_step.py,
# 1B shapes) a step of 80 adapters (190 decodes, 768 prefill tokens) takes 4.9 ms at 64 against 3.1 ms
# at 16; a step of 32 rank-16 adapters in 256-token prefill chunks 7.0 against 6.3 ms; 4,700 tokens in
# 1,024-token chunks 7.6 against 6.6 ms (each with `triton_backend.padded_tile_bound`).
PADDED_BLOCK_M = 16


class LoraBackend(ABC):
    """Tokens of a forward are ordered so that each adapter's tokens are contiguous: segment i is
    tokens `[seg_indptr[i], seg_indptr[i+1])`, all using adapter id `seg_slots[i]` (-1: no adapter)."""

    name: str

    def __init__(self, pool: LoraPool, max_tokens: int, max_seqs: int | None = None):
        """`max_seqs`: sequences one forward can hold (None: as many as tokens), which bounds the
        adapter runs of a batch together with the pool's ids."""
        self.pool = pool
        self.layout = pool.layout
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        # The prepared padded batch's tile class. Never 0, which graph keys use for "no adapters".
        self.tile_class = 1

    @abstractmethod
    def prepare(
        self,
        seg_indptr: Sequence[int],
        seg_slots: Sequence[int],
        pad_to: int | None = None,
        block_m: int | None = None,
        tile_class: int | str | None = None,
    ) -> None:
        """Build this forward's batch metadata (host-side lists in, no device reads). `pad_to`: the
        forward runs that many tokens, real ones first (padding has no adapter); `block_m`: the token
        tile of such a padded batch (None: the decode tile); `tile_class`: what its kernel configs are
        chosen for, one of `tile_classes` (an int), "auto" (the class of the batch's own tile count,
        left in `self.tile_class`) or None (the tile bound)."""

    def tile_classes(self, pad_to: int, block_m: int | None = None) -> tuple[int, ...]:
        """The tile classes a padded batch of `pad_to` tokens can be prepared for: one CUDA graph each
        (positive integers). A backend whose launches do not depend on the tile count has one, 1."""
        return (1,)

    def begin(self, x: torch.Tensor, layer: int, group: GroupLayout) -> None:
        """Called with a group's input before its base projection runs, and followed by that group's
        `apply` (or `apply_act`) before any other group's `begin`: a backend may start what needs x
        alone (the shrink) beside the projection. Nothing by default."""
        return None

    @abstractmethod
    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, group: GroupLayout) -> None:
        """out[T, group.out_total] += scaling * (x[T, group.in_dim] @ A^T) @ B^T, per token's adapter."""

    def apply_act(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        layer: int,
        group: GroupLayout,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`act(gate_up + delta)` for the gated MLP's gate_up group: the delta added as `apply` adds it,
        then the activation. `gate_up` may be changed. A backend may fuse the two (same rounding)."""
        self.apply(x, gate_up, layer, group)
        return act(gate_up)


def slot_segments(seqs: Sequence) -> tuple[list[int], list[int]]:
    """(seg_indptr, seg_slots) of sequences whose tokens are laid out in order (each with `token_ids`
    and `slot`, its adapter id); adjacent sequences of one adapter share a segment."""
    indptr, slots = [0], []
    for s in seqs:
        n = len(s.token_ids)
        if slots and slots[-1] == s.slot:
            indptr[-1] += n
        else:
            slots.append(s.slot)
            indptr.append(indptr[-1] + n)
    return indptr, slots
