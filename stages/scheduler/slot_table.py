"""Adapter residency in the fixed device slots: which adapter each slot holds, how many running
requests reference it, and least-recently-used eviction among unreferenced slots. Plain CPU code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SlotState:
    adapter: str | None = None
    refs: int = 0
    last_used: int = 0
    pinned: bool = False


class SlotTable:
    def __init__(self, num_slots: int, pinned: tuple[str, ...] = ()):
        self.slots = [SlotState() for _ in range(num_slots)]
        self.pinned = frozenset(pinned)
        self._clock = 0

    def slot_of(self, adapter: str) -> int | None:
        for i, s in enumerate(self.slots):
            if s.adapter == adapter:
                return i
        return None

    def choose_victim(self) -> int | None:
        """An empty slot, else the least recently used unreferenced, unpinned one; None if all busy."""
        best = None
        for i, s in enumerate(self.slots):
            if s.adapter is None:
                return i
            if s.refs == 0 and not s.pinned and (best is None or s.last_used < self.slots[best].last_used):
                best = i
        return best

    def assign(self, slot: int, adapter: str) -> str | None:
        """Put `adapter` into `slot`; returns the adapter it evicted, if any."""
        s = self.slots[slot]
        if s.refs:
            raise RuntimeError(f"slot {slot} holds {s.adapter!r} with {s.refs} references; cannot evict")
        evicted = s.adapter
        self.slots[slot] = SlotState(adapter=adapter, pinned=adapter in self.pinned)
        return evicted

    def acquire(self, slot: int) -> None:
        self._clock += 1
        self.slots[slot].refs += 1
        self.slots[slot].last_used = self._clock

    def release(self, slot: int) -> None:
        s = self.slots[slot]
        if s.refs <= 0:
            raise RuntimeError(f"slot {slot} released more often than acquired")
        s.refs -= 1

    def clear(self, slot: int) -> None:
        if self.slots[slot].refs:
            raise RuntimeError(f"slot {slot} is in use")
        self.slots[slot] = SlotState()
