"""One rank's shard of a packed adapter, S-LoRA's split: where the base projection is split by output
rows (Q/K/V, gate/up), A stays whole and B^T keeps the rank's output columns; where it is split by input
columns (O, down), A keeps the rank's input columns and B^T stays whole. A rank row of the whole layout
(what the loader packs and the host cache holds) maps to a rank row of the rank's layout by one gather
of columns; the alignment gaps of the rank's layout are zero."""

from __future__ import annotations

import contextlib

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
    """Cuts whole-layout packed adapters into this rank's layout, on the step thread of every rank at each
    slot load, so its host time adds to a step's.

    On CUDA the whole block goes to the device as it is (one copy, as a one-rank pool's) into a staging
    buffer of one largest-rank adapter, and one gather kernel cuts the shard into a second buffer, from
    which the pool copies it: a few launches of host time, where cutting it on the host cost 1-3 ms of a
    1B-shaped rank-16 adapter (and a gather by index there 15-20 ms). Each rank copies the whole block's
    bytes (1.5 times its shard's at TP=2 for Llama's shapes). The returned block is those buffers' until
    the next call; the pool's copy, issued after it on the same stream, reads it first, and a call on
    another stream waits for the last one's.

    On the CPU a shard is a few slices of whole columns (one per slice's A and B^T, adjacent ones merged):
    one strided copy per run."""

    def __init__(
        self,
        whole: LoraLayout,
        part: LoraLayout,
        rank: int,
        size: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        """`device`/`dtype`: the pool's; a CUDA device shards on it (its buffers are allocated now, before
        the KV cache takes what is left)."""
        self.whole, self.part = whole, part
        index = shard_columns(whole, part, rank, size)
        self.runs = column_runs(index)
        self.device = device if device is not None and device.type == "cuda" else None
        if self.device is not None:
            L, R = whole.num_layers, whole.max_rank
            self._staging = torch.empty(L * R * whole.row_elems, dtype=dtype, device=self.device)
            self._out = torch.empty(L * R * part.row_elems, dtype=dtype, device=self.device)
            self._index = index.clamp(min=0).to(self.device)
            gaps = (index < 0).nonzero().flatten()
            self._gaps = gaps.to(self.device) if gaps.numel() else None
            self._last: torch.cuda.Stream | None = None  # the stream of the last call

    def __call__(self, adapter: PackedAdapter, stream: torch.cuda.Stream | None = None) -> PackedAdapter:
        """The rank's shard of `adapter`; on CUDA a device block, cut on `stream` (default: the current)."""
        block = adapter.block
        if block.shape[2] != self.whole.row_elems:
            raise ValueError(f"adapter {adapter.name!r} was packed for another model layout")
        if self.device is not None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                out = self._on_device(adapter)
        else:
            out = torch.empty(
                (*block.shape[:2], self.part.row_elems), dtype=block.dtype, pin_memory=block.is_pinned()
            )
            for at, first, n in self.runs:
                if first < 0:
                    out[:, :, at : at + n].zero_()
                else:
                    out[:, :, at : at + n].copy_(block[:, :, first : first + n])
        return PackedAdapter(adapter.name, out, adapter.ranks, adapter.scalings)

    def _on_device(self, adapter: PackedAdapter) -> torch.Tensor:
        block = adapter.block
        L, r, E = block.shape
        if r > self.whole.max_rank:  # the pool refuses it by name too; the staging holds no more
            raise ValueError(f"adapter {adapter.name!r}: rank {r} > max_lora_rank {self.whole.max_rank}")
        if block.dtype != self._staging.dtype:
            raise ValueError(f"adapter {adapter.name!r} was packed for another model layout or dtype")
        current = torch.cuda.current_stream(self.device)
        if self._last is not None and self._last != current:
            current.wait_stream(self._last)  # the last shard's copies (and the pool's of it) read these
        self._last = current
        staged = self._staging[: L * r * E].view(L, r, E)
        # a pinned block's copy is recorded with the host allocator (or the block is registered host
        # memory that outlives the load), so it is not reused before the copy completes
        staged.copy_(block, non_blocking=block.is_pinned())
        out = self._out[: L * r * self.part.row_elems].view(L, r, self.part.row_elems)
        torch.index_select(staged, 2, self._index, out=out)
        if self._gaps is not None:
            out.index_fill_(2, self._gaps, 0)
        return out
