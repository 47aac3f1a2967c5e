"""One rank's shard of a packed adapter, S-LoRA's split: where the base projection is split by output
rows (Q/K/V, gate/up), A stays whole and B^T keeps the rank's output columns; where it is split by input
columns (O, down), A keeps the rank's input columns and B^T stays whole. A rank row of the whole layout
(what the loader packs and the host cache holds) maps to a rank row of the rank's layout by one gather
of columns; the alignment gaps of the rank's layout are zero."""

from __future__ import annotations

import torch

from runtime.common.lora_layout import GroupLayout, LoraLayout
from runtime.common.packed import PackedAdapter

ROW_SPLIT_GROUPS = ("o", "down")  # base weight split by input columns: A split, B whole


def shard_columns(whole: LoraLayout, part: LoraLayout, rank: int, size: int) -> torch.Tensor:
    """[part.row_elems] int64: the whole-layout column each column of the rank's layout takes (-1: an
    alignment gap, zero)."""
    index = torch.full((part.row_elems,), -1, dtype=torch.int64)
    for gw in whole.groups:
        gp = part.group(gw.name)
        split_in = gw.name in ROW_SPLIT_GROUPS
        for s in range(gw.num_slices):  # A rows of each slice
            n = gp.in_dim
            first = gw.a_offset + s * gw.in_stride + (rank * n if split_in else 0)
            at = gp.a_offset + s * gp.in_stride
            index[at : at + n] = torch.arange(first, first + n)
        for s in range(gw.num_slices):  # B^T columns of each slice
            n = gp.out_dims[s]
            first = gw.b_offset + gw.out_offsets[s] + (0 if split_in else rank * n)
            at = gp.b_offset + gp.out_offsets[s]
            index[at : at + n] = torch.arange(first, first + n)
        _check_group(gw, gp, size, split_in)
    return index


def _check_group(gw: GroupLayout, gp: GroupLayout, size: int, split_in: bool) -> None:
    ins = gw.in_dim // size if split_in else gw.in_dim
    outs = gw.out_dims if split_in else tuple(d // size for d in gw.out_dims)
    if gp.in_dim != ins or gp.out_dims != outs:
        raise ValueError(f"LoRA group {gw.name}: the rank's layout is not a {size}-way shard of the whole")


class AdapterSharder:
    """Cuts whole-layout packed adapters into this rank's layout."""

    def __init__(self, whole: LoraLayout, part: LoraLayout, rank: int, size: int):
        self.whole, self.part = whole, part
        index = shard_columns(whole, part, rank, size)
        self.gaps = index < 0
        self.index = index.clamp(min=0)

    def __call__(self, adapter: PackedAdapter) -> PackedAdapter:
        block = adapter.block
        if block.shape[2] != self.whole.row_elems:
            raise ValueError(f"adapter {adapter.name!r} was packed for another model layout")
        out = torch.empty(
            (*block.shape[:2], self.part.row_elems), dtype=block.dtype, pin_memory=block.is_pinned()
        )
        torch.index_select(block, 2, self.index, out=out)
        if self.gaps.any():
            out[:, :, self.gaps] = 0
        return PackedAdapter(adapter.name, out, adapter.ranks, adapter.scalings)
