"""Where each waiting request's adapter stands and which slot loads to issue: demand placement at
admission, and prefetch of the adapters of the next `prefetch_depth` waiting requests into free
slots or slots no running or nearer waiting request needs. Plain CPU code over the SlotTable."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum

from proto.plan import SlotLoad
from stages.scheduler.slot_table import SlotTable


class Place(Enum):
    BASE = "base"  # no adapter
    RESIDENT = "resident"  # in a settled slot: may run now
    LOADING = "loading"  # its copy is in flight: may run now, each layer waiting for its own copy
    LOAD = "load"  # a victim slot was chosen: issue a load (the request may run in the same step)
    WAIT = "wait"  # not staged yet, or no slot can be freed


class Residency:
    """`adapter_ready(name)`: the adapter's host block can be copied into a slot now.
    `overlapped(name)`: its load marks the slot loading until the worker reports it ready (it is then
    never a victim, and prefetch may issue it ahead of need); otherwise it is only loaded for the step
    that admits its requests (the right call for loads much cheaper than a step). Either way a request
    may run while its slot is still being copied: the worker makes each layer wait for its own part."""

    def __init__(
        self,
        slots: SlotTable,
        adapter_ready: Callable[[str], bool],
        overlapped: Callable[[str], bool],
        prefetch_depth: int,
    ):
        self.slots = slots
        self.adapter_ready = adapter_ready
        self.overlapped = overlapped
        self.prefetch_depth = prefetch_depth
        self.loads_issued = 0

    def place(self, adapter: str | None, nearer: Iterable[str] = ()) -> tuple[Place, int]:
        """Where `adapter` can run; with overlap a victim never holds an adapter in `nearer` (needed
        by a waiting request ahead of this one)."""
        if adapter is None:
            return Place.BASE, -1
        slot = self.slots.slot_of(adapter)
        if slot is not None:
            return (Place.LOADING, slot) if self.slots.is_loading(slot) else (Place.RESIDENT, slot)
        if not self.adapter_ready(adapter):
            return Place.WAIT, -1
        victim = self.slots.choose_victim(exclude=set(nearer) if self.overlapped(adapter) else ())
        return (Place.WAIT, -1) if victim is None else (Place.LOAD, victim)

    def issue(self, slot: int, adapter: str, loads: list[SlotLoad]) -> None:
        overlapped = self.overlapped(adapter)
        self.slots.assign(slot, adapter, loading=overlapped)
        loads.append(SlotLoad(slot=slot, adapter=adapter, layered=overlapped))
        self.loads_issued += 1

    def prefetch(self, waiting: Iterable[str | None], loads: list[SlotLoad]) -> None:
        """Issue loads for the adapters of the next `prefetch_depth` waiting requests (`waiting`: their
        adapters in queue order). A victim prefers slots no request in the window needs, and never
        holds an adapter a running request (refs) or a nearer waiting request needs. Adapters cheap
        enough to load synchronously are left to admission: evicting for them only churns slots."""
        window = [a for _, a in zip(range(self.prefetch_depth), waiting, strict=False)]
        wanted = {a for a in window if a is not None}
        nearer: set[str] = set()
        for adapter in window:
            if adapter is None:
                continue
            if not self.overlapped(adapter):
                nearer.add(adapter)
                continue
            if self.slots.slot_of(adapter) is None and self.adapter_ready(adapter):
                victim = self.slots.choose_victim(exclude=wanted)
                if victim is None:
                    victim = self.slots.choose_victim(exclude=nearer)
                if victim is None:
                    return  # every slot is in use or needed sooner
                self.issue(victim, adapter, loads)
            nearer.add(adapter)
