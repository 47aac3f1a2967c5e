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


def column_runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """`index` (`shard_columns`) as maximal runs (rank column, whole column, columns): each run is a
    slice of whole-layout columns in order (whole column -1: a run of alignment gaps)."""
    runs: list[tuple[int, int, int]] = []
    for at, first in enumerate(index.tolist()):
        if runs:
            start, src, n = runs[-1]
            if (src < 0 and first < 0) or (src >= 0 and first == src + n):
                runs[-1] = (start, src, n + 1)
                continue
        runs.append((at, first if first >= 0 else -1, 1))
    return runs


class AdapterSharder:
    """Cuts whole-layout packed adapters into this rank's layout. A shard is a few slices of whole
    columns (one per slice's A and B^T, adjacent ones merged), so it is cut with one strided copy per
    run: a gather of every element by index cost 15-20 ms of a 1B-shaped rank-16 adapter on the host,
    on the step thread of every rank at each slot load, where the copies take about 1 ms."""

    def __init__(self, whole: LoraLayout, part: LoraLayout, rank: int, size: int):
        self.whole, self.part = whole, part
        self.runs = column_runs(shard_columns(whole, part, rank, size))

    def __call__(self, adapter: PackedAdapter) -> PackedAdapter:
        block = adapter.block
        if block.shape[2] != self.whole.row_elems:
            raise ValueError(f"adapter {adapter.name!r} was packed for another model layout")
        out = torch.empty(
            (*block.shape[:2], self.part.row_elems), dtype=block.dtype, pin_memory=block.is_pinned()
        )
        for at, first, n in self.runs:
            if first < 0:
                out[:, :, at : at + n].zero_()
            else:
                out[:, :, at : at + n].copy_(block[:, :, first : first + n])
        return PackedAdapter(adapter.name, out, adapter.ranks, adapter.scalings)
