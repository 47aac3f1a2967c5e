"""The host tier of adapter residency: packed adapter blocks inside one shared-memory pool that the
launcher creates (so it outlives a loader restart) and the worker maps once and pins for fast copies.
Blocks are placed first-fit; when the pool or the adapter count is full, unpinned blocks go LRU."""

from __future__ import annotations

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

    def __init__(self, capacity_bytes: int, max_adapters: int):
        if max_adapters < 1:
            raise ValueError("the host cache must hold at least one adapter")
        self.capacity = capacity_bytes
        self.max_adapters = max_adapters
        self.blocks: OrderedDict[str, HostBlock] = OrderedDict()  # least recently used first

    def get(self, name: str) -> HostBlock | None:
        block = self.blocks.get(name)
        if block is not None:
            self.blocks.move_to_end(name)
        return block

    def reserve(self, name: str, nbytes: int) -> tuple[HostBlock, list[str]]:
        """Place a new block for `name`; returns it and the names evicted to make room."""
        if name in self.blocks:
            raise ValueError(f"{name!r} is already in the host cache")
        size = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if size > self.capacity:
            raise HostCacheFull(f"adapter {name!r} needs {size} bytes; the host cache holds {self.capacity}")
        evicted = []
        while True:
            offset = self._first_fit(size) if len(self.blocks) < self.max_adapters else None
            if offset is not None:
                break
            victim = next((b for b in self.blocks.values() if b.pins == 0), None)
            if victim is None:
                raise HostCacheFull(
                    f"no room for adapter {name!r}: every cached adapter is in use", retryable=True
                )
            del self.blocks[victim.name]
            evicted.append(victim.name)
        block = HostBlock(name, offset, nbytes)
        self.blocks[name] = block
        return block, evicted

    def drop(self, name: str) -> bool:
        return self.blocks.pop(name, None) is not None

    def pin(self, name: str) -> None:
        self.blocks[name].pins += 1

    def unpin(self, name: str) -> None:
        block = self.blocks.get(name)
        if block is not None and block.pins > 0:
            block.pins -= 1

    def _first_fit(self, size: int) -> int | None:
        cursor = 0
        for b in sorted(self.blocks.values(), key=lambda b: b.offset):
            if b.offset - cursor >= size:
                return cursor
            cursor = b.offset + (b.nbytes + ALIGN - 1) // ALIGN * ALIGN
        return cursor if self.capacity - cursor >= size else None
