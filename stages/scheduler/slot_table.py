"""Adapter residency in the fixed device slots: which adapter each slot holds, how many running
requests reference it, which slots are still being copied into (overlapped loading), and
least-recently-used eviction among unreferenced, settled slots. Plain CPU code."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass
class SlotState:
    adapter: str | None = None
    refs: int = 0
    last_used: int = 0
    pinned: bool = False
    loading: bool = False  # a copy was issued and the worker has not reported the slot ready


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

    def is_loading(self, slot: int) -> bool:
        return self.slots[slot].loading

    def choose_victim(self, exclude: Collection[str] = ()) -> int | None:
        """An empty slot, else the least recently used unreferenced, unpinned, settled one whose
        adapter is not in `exclude` (needed sooner); None if there is none."""
        best = None
        for i, s in enumerate(self.slots):
            if s.adapter is None and not s.loading:
                return i
            if s.refs or s.pinned or s.loading or s.adapter in exclude:
                continue
            if best is None or s.last_used < self.slots[best].last_used:
                best = i
        return best

    def assign(self, slot: int, adapter: str, loading: bool = False) -> str | None:
        """Put `adapter` into `slot`; returns the adapter it evicted, if any. A slot counts as just
        used, so a block copied for a request still waiting is not the next LRU victim."""
        s = self.slots[slot]
        if s.refs or s.loading:
            raise RuntimeError(f"slot {slot} holds {s.adapter!r} with {s.refs} references; cannot evict")
        evicted = s.adapter
        self._clock += 1
        self.slots[slot] = SlotState(
            adapter=adapter, pinned=adapter in self.pinned, loading=loading, last_used=self._clock
        )
        return evicted

    def mark_ready(self, slot: int) -> None:
        """The worker reported the slot's copy complete: it may be a victim again once unreferenced."""
        self.slots[slot].loading = False

    def acquire(self, slot: int) -> None:
        """A request uses the slot (also while it is loading: the worker waits layer by layer)."""
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
