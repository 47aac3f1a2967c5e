"""The fixed set of device LoRA slots: one memory block per slot plus per-slot rank and scaling tables,
with a host mirror of the tables so the host can plan without reading the device."""

from __future__ import annotations

import contextlib

import torch

from stages.worker.lora.layout import NUM_SLICES, LoraLayout
from stages.worker.lora.packed import PackedAdapter


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
        still copy. Without, it is one host→device copy: a block of rank below max_rank lands in a
        device temporary that one kernel spreads into the slot's rows, since per-layer copies of a
        small block cost more in launches than its transfer."""
        if adapter.rank > self.layout.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r}: rank {adapter.rank} > max_lora_rank {self.layout.max_rank}"
            )
        if adapter.block.dtype != self.dtype or adapter.block.shape[2] != self.layout.row_elems:
            raise ValueError(f"adapter {adapter.name!r} was packed for another model layout or dtype")
        r = adapter.rank
        non_blocking = adapter.block.is_pinned()
        events = [] if layer_events and self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.ranks[slot].copy_(adapter.ranks, non_blocking=non_blocking)
            self.scalings[slot].copy_(adapter.scalings, non_blocking=non_blocking)
            if events is None:
                self.mem[slot, :, :r].copy_(adapter.block, non_blocking=non_blocking)
            else:
                for layer in range(self.layout.num_layers):
                    self.mem[slot, layer, :r].copy_(adapter.block[layer], non_blocking=non_blocking)
                    events.append(torch.cuda.Event())
                    events[-1].record()
        self.host_ranks[slot] = adapter.ranks
        self.host_scalings[slot] = adapter.scalings
        self.names[slot] = adapter.name
        return events

    def clear(self, slot: int) -> None:
        """Mark a slot empty. Its memory is left as is: rank 0 makes every kernel skip it."""
        self.ranks[slot].zero_()
        self.host_ranks[slot].zero_()
        self.names[slot] = None
