"""The fixed set of device LoRA slots: one memory block per slot plus per-slot rank and scaling tables,
with a host mirror of the tables so the host can plan without reading the device."""

from __future__ import annotations

import contextlib

import torch

from stages.worker.lora.layout import NUM_SLICES, LoraLayout
from stages.worker.lora.packed import PackedAdapter
from stages.worker.lora.pitched_copy import copy_rows


def _pinned(t: torch.Tensor, cuda: bool) -> torch.Tensor:
    return t.pin_memory() if cuda and not t.is_pinned() else t


class LoraSlots:
    def __init__(self, layout: LoraLayout, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = device
        # [num_slots, num_layers, max_rank, row_elems]
        self.mem = torch.zeros(
            (num_slots, layout.num_layers, layout.max_rank, layout.row_elems), dtype=dtype, device=device
        )
        # [num_slots, num_layers, NUM_SLICES]; rank 0 = slice not adapted (or slot empty)
        self.ranks = torch.zeros((num_slots, layout.num_layers, NUM_SLICES), dtype=torch.int32, device=device)
        self.scalings = torch.zeros_like(self.ranks, dtype=torch.float32)
        self.host_ranks = torch.zeros_like(self.ranks, device="cpu")
        self.host_scalings = torch.zeros_like(self.scalings, device="cpu")
        self.names: list[str | None] = [None] * num_slots
        self._held: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # sources of pitched copies in flight

    def load(
        self,
        slot: int,
        adapter: PackedAdapter,
        stream: torch.cuda.Stream | None = None,
        layer_events: bool = False,
    ) -> list[torch.cuda.Event] | None:
        """Copy a packed adapter into `slot` (on `stream` when given): ranks and scalings, then the block.
        The caller orders later reads of the slot after this copy. With `layer_events` (CUDA) the block
        goes one contiguous copy per layer, in order, and the caller gets one event per layer, recorded
        once that layer (and everything before it) is in, so layer i may compute while later layers
        still copy. Without, it is one host→device copy (a pitched one from pinned memory when the rank is
        below max_rank), since per-layer copies of a small block cost more in launches than its
        transfer."""
        if adapter.rank > self.layout.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r}: rank {adapter.rank} > max_lora_rank {self.layout.max_rank}"
            )
        if adapter.block.dtype != self.dtype or adapter.block.shape[2] != self.layout.row_elems:
            raise ValueError(f"adapter {adapter.name!r} was packed for another model layout or dtype")
        r = adapter.rank
        cuda = self.device.type == "cuda"
        pinned = adapter.block.is_pinned()
        events = [] if layer_events and cuda else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # the tables from pinned memory too: a pageable copy may wait for the stream's earlier copies
            self.ranks[slot].copy_(_pinned(adapter.ranks, cuda), non_blocking=cuda)
            self.scalings[slot].copy_(_pinned(adapter.scalings, cuda), non_blocking=cuda)
            if events is None:
                if not (cuda and pinned and r < self.layout.max_rank and self._pitched(slot, adapter)):
                    self.mem[slot, :, :r].copy_(adapter.block, non_blocking=pinned)
            else:
                for layer in range(self.layout.num_layers):
                    self.mem[slot, layer, :r].copy_(adapter.block[layer], non_blocking=pinned)
                    events.append(torch.cuda.Event())
                    events[-1].record()
        self.host_ranks[slot] = adapter.ranks
        self.host_scalings[slot] = adapter.scalings
        self.names[slot] = adapter.name
        return events

    def _pitched(self, slot: int, adapter: PackedAdapter) -> bool:
        """One pitched DMA of the block into the first `rank` rows of each layer, on the current stream;
        the block is held until that copy completed (a caching host allocator may reuse it otherwise)."""
        self._held = [(e, t) for e, t in self._held if not e.query()]
        stream = torch.cuda.current_stream(self.device)
        if not copy_rows(self.mem[slot, :, : adapter.rank], adapter.block, stream):
            return False
        done = torch.cuda.Event()
        done.record(stream)
        self._held.append((done, adapter.block))
        return True

    def clear(self, slot: int) -> None:
        """Mark a slot empty. Its memory is left as is: rank 0 makes every kernel skip it."""
        self.ranks[slot].zero_()
        self.host_ranks[slot].zero_()
        self.names[slot] = None
