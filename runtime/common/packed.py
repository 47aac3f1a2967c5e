"""A validated adapter packed contiguously (the host-cache form), copied into a device slot in one copy
or one per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PackedAdapter:
    """`block` is `[num_layers, rank, row_elems]` in the model dtype, laid out as `LoraLayout` says;
    `ranks`/`scalings` are `[num_layers, NUM_SLICES]` (rank 0 marks a module the adapter does not target)."""

    name: str
    block: torch.Tensor  # [num_layers, rank, row_elems]
    ranks: torch.Tensor  # [num_layers, NUM_SLICES] int32
    scalings: torch.Tensor  # [num_layers, NUM_SLICES] float32

    @property
    def rank(self) -> int:
        return self.block.shape[1]

    @property
    def nbytes(self) -> int:
        return self.block.numel() * self.block.element_size()
