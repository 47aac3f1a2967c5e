"""The fixed set of device LoRA slots: one memory block per slot plus per-slot rank and scaling tables,
with a host mirror of the tables so the host can plan without reading the device."""

from __future__ import annotations

import contextlib

import torch

from runtime.common.lora_layout import NUM_SLICES, LoraLayout
from runtime.common.packed import PackedAdapter
from stages.worker.lora.pitched_copy import copy_rows


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
        if device.type == "cuda":
            # pinned staging of each slot's tables: copied without waiting on anything, reused once the
            # slot's previous table copy is done (a fresh pin per load cost more host time than a copy)
            self._stage_ranks = torch.empty_like(self.host_ranks).pin_memory()
            self._stage_scalings = torch.empty_like(self.host_scalings).pin_memory()
            self._staged: list[torch.cuda.Event | None] = [None] * num_slots

    def load(
        self,
        slot: int,
        adapter: PackedAdapter,
        stream: torch.cuda.Stream | None = None,
        layer_events: bool = False,
    ) -> list[torch.cuda.Event] | None:
        """Copy a packed adapter and its rank and scaling tables into `slot` (on `stream` when given).
        The caller orders later reads of the slot after this copy. With `layer_events` (CUDA) the tables
        go first, then the block one contiguous copy per layer, in order, and the caller gets one event
        per layer, recorded once that layer (and everything before it) is in, so layer i may compute
        while later layers still copy. Without, the block is one host→device copy (a pitched one from
        pinned memory when the rank is below max_rank), since per-layer copies of a small block cost
        more in launches than its transfer."""
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
            if events is None:  # the block first, so its DMA starts while the tables are issued
                if not (cuda and pinned and r < self.layout.max_rank and self._pitched(slot, adapter)):
                    self.mem[slot, :, :r].copy_(adapter.block, non_blocking=pinned)
                self._copy_tables(slot, adapter)
            else:  # the tables first: layer 0 may run once its own rows are in
                self._copy_tables(slot, adapter)
                for layer in range(self.layout.num_layers):
                    self.mem[slot, layer, :r].copy_(adapter.block[layer], non_blocking=pinned)
                    events.append(torch.cuda.Event())
                    events[-1].record()
        self.host_ranks[slot] = adapter.ranks
        self.host_scalings[slot] = adapter.scalings
        self.names[slot] = adapter.name
        return events

    def _copy_tables(self, slot: int, adapter: PackedAdapter) -> None:
        """Ranks and scalings into the slot's device tables (on the current stream); on CUDA through the
        slot's pinned staging, since a copy from pageable memory may wait for the stream's earlier work."""
        if self.device.type != "cuda":
            self.ranks[slot].copy_(adapter.ranks)
            self.scalings[slot].copy_(adapter.scalings)
            return
        previous = self._staged[slot]
        if previous is not None:
            previous.synchronize()  # the staging rows' last copy (long done unless loads come back to back)
        self._stage_ranks[slot].copy_(adapter.ranks)
        self._stage_scalings[slot].copy_(adapter.scalings)
        self.ranks[slot].copy_(self._stage_ranks[slot], non_blocking=True)
        self.scalings[slot].copy_(self._stage_scalings[slot], non_blocking=True)
        done = self._staged[slot] = torch.cuda.Event()
        done.record()

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
