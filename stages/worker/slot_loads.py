"""Slot copies in flight on the worker: one handle per load (its completion event on the load
stream), waited on by the compute stream only in a step that uses the slot, and polled without
blocking so the slot can be reported ready. No sockets; owned by the StepExecutor."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LoadHandle:
    slot: int
    nbytes: int
    issued: float = field(default_factory=time.perf_counter)
    event: Any = None  # torch.cuda.Event recorded after the copy on the load stream; None: done
    start_event: Any = None  # recorded before the copy (enable_timing), for the copy's own time
    copy_seconds: float = 0.0  # known up front for a synchronous copy
    waited: bool = False  # a step's compute stream had to wait on it (the copy did not overlap)
    layer_events: list[Any] | None = None  # one per layer, in copy order (CUDA loads)

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def seconds(self) -> float:
        """How long the copy itself took (device time when it ran on a stream)."""
        if self.event is not None and self.start_event is not None:
            self.event.synchronize()  # a no-op once done(); a synchronous load's step waits anyway
            return self.start_event.elapsed_time(self.event) / 1e3
        return self.copy_seconds


class PendingLoads:
    """Per-slot loads not yet reported ready. `on_done(handle)` sees each load once it completed."""

    def __init__(self, on_done: Callable[[LoadHandle], None] | None = None):
        self.by_slot: dict[int, LoadHandle] = {}
        self.on_done = on_done

    def __bool__(self) -> bool:
        return bool(self.by_slot)

    def add(self, handle: LoadHandle) -> None:
        self.by_slot[handle.slot] = handle

    def discard(self, slot: int) -> None:
        self.by_slot.pop(slot, None)

    def wait_for(self, slots: set[int], device: torch.device) -> None:
        """Make the compute stream wait for the copies into `slots` (a step is about to read them)."""
        for slot in slots & self.by_slot.keys():
            h = self.by_slot[slot]
            if h.event is not None and not h.waited:
                torch.cuda.current_stream(device).wait_event(h.event)
                h.waited = True

    def layer_waits(self, slots: set[int], num_layers: int) -> list[list[Any]] | None:
        """Per-layer events a step must wait on before each layer, for the copies into `slots` that
        have them (the step's compute then overlaps the rest of those copies); None if there are none.
        Copies without per-layer events get a whole wait, as in `wait_for`. A copy that has already
        completed (a prefetch issued steps ago) needs no wait: the step may then replay a graph."""
        waits: list[list[Any]] = [[] for _ in range(num_layers)]
        for slot in slots & self.by_slot.keys():
            h = self.by_slot[slot]
            if h.event is None or h.waited or h.event.query():
                continue
            h.waited = True
            if h.layer_events is None or len(h.layer_events) != num_layers:
                waits[0].append(h.event)
            else:
                for layer, ev in enumerate(h.layer_events):
                    waits[layer].append(ev)
        return waits if any(waits) else None

    def poll(self) -> list[int]:
        """Slots whose copy has completed (never blocks); they leave the pending set."""
        ready = [slot for slot, h in self.by_slot.items() if h.done()]
        for slot in ready:
            h = self.by_slot.pop(slot)
            if self.on_done is not None:
                self.on_done(h)
        return ready
