"""The host cache's table: where each adapter's packed block sits in the shared-memory host pool. The
scheduler owns it (the loader writes where it is told, the worker copies from where a SlotLoad says).
Sized in bytes, each block rounded up to the pool's page alignment; blocks are placed first fit. A
placement that needs room evicts victims the caller offers, in the caller's order, and either fits
with some of them gone or changes nothing. Plain CPU code."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from runtime.common.host_pool import ALIGN


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class HostRange:
    offset: int
    size: int  # aligned bytes reserved


class HostTable:
    """`max_blocks`: the optional cap on blocks (--max-cpu-loras)."""

    def __init__(self, capacity: int, max_blocks: int | None = None) -> None:
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("the host cache must hold at least one adapter")
        self.capacity = capacity
        self.max_blocks = max_blocks
        self.ranges: OrderedDict[str, HostRange] = OrderedDict()  # least recently used first
        self._starts: list[tuple[int, str]] = []  # (offset, name) of every range, sorted

    def __contains__(self, name: str) -> bool:
        return name in self.ranges

    def get(self, name: str) -> HostRange | None:
        return self.ranges.get(name)

    def touch(self, name: str) -> None:
        if name in self.ranges:
            self.ranges.move_to_end(name)

    def lru(self) -> list[str]:
        """Names, least recently used first."""
        return list(self.ranges)

    def place(self, name: str, nbytes: int, victims: Iterable[str] = ()) -> tuple[int, list[str]] | None:
        """Reserve `nbytes` for `name`, evicting the fewest of `victims` (taken in order) that make it
        fit; returns (offset, evicted), or None with nothing changed when even all of them would not."""
        if name in self.ranges:
            raise ValueError(f"{name!r} already has a host range")
        size = aligned(nbytes)
        if size > self.capacity:
            return None
        gone: list[str] = []
        offset = self._fit(size, gone)
        pending = iter(victims)
        while offset is None:
            victim = next(pending, None)
            if victim is None:
                return None
            if victim in self.ranges and victim not in gone:
                gone.append(victim)
                offset = self._fit(size, gone)
        for victim in gone:
            self.free(victim)
        self.ranges[name] = HostRange(offset, size)
        bisect.insort(self._starts, (offset, name))
        return offset, gone

    def shrink(self, name: str, nbytes: int) -> None:
        """Give back the tail of `name`'s range past `nbytes` (a block reserved at its upper bound)."""
        r = self.ranges[name]
        r.size = min(r.size, aligned(nbytes))

    def free(self, name: str) -> bool:
        r = self.ranges.pop(name, None)
        if r is None:
            return False
        del self._starts[bisect.bisect_left(self._starts, (r.offset, name))]
        return True

    @property
    def used_bytes(self) -> int:
        return sum(r.size for r in self.ranges.values())

    def largest_free(self) -> int:
        """The largest block placed without evicting (fragmentation shows as this << free bytes)."""
        return max((end - start for start, end in self._gaps(())), default=0)

    def _fit(self, size: int, gone: list[str]) -> int | None:
        if self.max_blocks is not None and len(self.ranges) - len(gone) >= self.max_blocks:
            return None
        return next((start for start, end in self._gaps(gone) if end - start >= size), None)

    def _gaps(self, gone: Iterable[str]):
        """(start, end) of every free range in offset order, counting the ranges of `gone` as free."""
        skip = set(gone)
        cursor = 0
        for offset, name in self._starts:
            if name in skip:
                continue
            yield cursor, offset
            cursor = offset + self.ranges[name].size
        yield cursor, self.capacity
