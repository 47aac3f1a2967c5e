"""The host tier of adapter residency: packed adapter blocks inside one shared-memory pool that the
launcher creates (so it outlives a loader restart) and the worker maps once and pins for fast copies.
Sized in bytes: a block takes its own rank's bytes. Blocks are placed first-fit; when no gap fits (or the
optional adapter cap is reached), unpinned blocks go least-recently-used first."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass

from runtime.common.host_pool import ALIGN


@dataclass
class HostBlock:
    name: str
    offset: int
    nbytes: int
    pins: int = 0  # a pinned block is being copied to a slot (or about to be): never evicted


class HostCacheFull(RuntimeError):
    """`retryable`: room will come back once pinned blocks are released (else the block can never fit)."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class HostCache:
    """Bookkeeping only (offsets inside the pool); the loader writes the bytes, the worker reads them."""

    def __init__(self, capacity_bytes: int, max_adapters: int | None = None):
        if max_adapters is not None and max_adapters < 1:
            raise ValueError("the host cache must hold at least one adapter")
        self.capacity = capacity_bytes
        self.max_adapters = max_adapters
        self.blocks: OrderedDict[str, HostBlock] = OrderedDict()  # least recently used first
        self._by_offset: list[tuple[int, str]] = []  # (offset, name) of every block, sorted

    def get(self, name: str) -> HostBlock | None:
        block = self.blocks.get(name)
        if block is not None:
            self.blocks.move_to_end(name)
        return block

    def reserve(self, name: str, nbytes: int) -> tuple[HostBlock, list[str]]:
        """Place a new block for `name`; returns it and the names evicted to make room."""
        if name in self.blocks:
            raise ValueError(f"{name!r} is already in the host cache")
        size = _aligned(nbytes)
        if size > self.capacity:
            raise HostCacheFull(f"adapter {name!r} needs {size} bytes; the host cache holds {self.capacity}")
        evicted = []
        while True:
            full = self.max_adapters is not None and len(self.blocks) >= self.max_adapters
            offset = None if full else self._first_fit(size)
            if offset is not None:
                break
            victim = next((b for b in self.blocks.values() if b.pins == 0), None)
            if victim is None:
                raise HostCacheFull(
                    f"no room for adapter {name!r}: every cached adapter is in use", retryable=True
                )
            self.drop(victim.name)
            evicted.append(victim.name)
        block = HostBlock(name, offset, nbytes)
        self.blocks[name] = block
        bisect.insort(self._by_offset, (offset, name))
        return block, evicted

    def drop(self, name: str) -> bool:
        block = self.blocks.pop(name, None)
        if block is None:
            return False
        del self._by_offset[bisect.bisect_left(self._by_offset, (block.offset, name))]
        return True

    def pin(self, name: str) -> None:
        self.blocks[name].pins += 1

    def unpin(self, name: str) -> None:
        block = self.blocks.get(name)
        if block is not None and block.pins > 0:
            block.pins -= 1

    @property
    def used_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks.values())

    def largest_free(self) -> int:
        """The largest block that fits without evicting (fragmentation shows as this << free bytes)."""
        return max(end - start for start, end in self._free_gaps()) if self._by_offset else self.capacity

    def _first_fit(self, size: int) -> int | None:
        return next((start for start, end in self._free_gaps() if end - start >= size), None)

    def _free_gaps(self):
        """(start, end) of every free range, in offset order (empty ranges included)."""
        cursor = 0
        for offset, name in self._by_offset:
            yield cursor, offset
            cursor = offset + _aligned(self.blocks[name].nbytes)
        yield cursor, self.capacity


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN
