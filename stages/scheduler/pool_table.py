"""Adapter residency in the GPU adapter pool: which adapters are resident under which id and in which
rank rows, how many running requests reference each, which are still being copied (overlapped
loading), and least-recently-used eviction among unreferenced, settled, unpinned adapters until a new
one fits. The single owner of ids and rows (the worker only copies where it is told). Plain CPU code."""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass

from stages.scheduler.row_allocator import RowAllocator, Run


@dataclass
class Resident:
    adapter: str
    lora_id: int
    runs: list[Run]  # pool rows holding rank rows 0..rows-1, in order
    refs: int = 0  # running requests using it
    last_used: int = 0
    pinned: bool = False  # --pin-adapter: never evicted once loaded
    loading: bool = False  # an overlapped copy was issued and the worker has not reported it ready

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def evictable(self) -> bool:
        return not (self.refs or self.pinned or self.loading)


class PoolTable:
    """`pinned` adapters stay once loaded, as long as the rows no pinned adapter holds still fit an
    adapter of `max_rank` (beyond that a pin is not honoured, so that every adapter can still load)."""

    def __init__(self, total_rows: int, num_ids: int, pinned: Collection[str] = (), max_rank: int = 0):
        if num_ids < 1:
            raise ValueError(f"the adapter pool needs at least one id, got {num_ids}")
        self.rows = RowAllocator(total_rows)
        self.num_ids = num_ids
        self.pinned = frozenset(pinned)
        self.max_rank = max_rank
        self.residents: dict[str, Resident] = {}
        self.by_id: dict[int, Resident] = {}
        self._free_ids = list(range(num_ids))  # a heap: the lowest free id first
        self._clock = 0

    @property
    def free_ids(self) -> int:
        return len(self._free_ids)

    @property
    def used_rows(self) -> int:
        return self.rows.total_rows - self.rows.num_free

    def get(self, adapter: str) -> Resident | None:
        return self.residents.get(adapter)

    def id_of(self, adapter: str) -> int | None:
        r = self.residents.get(adapter)
        return None if r is None else r.lora_id

    def victims(self, rows: int, exclude: Collection[str] = ()) -> list[str] | None:
        """The adapters to evict, least recently used first, so that `rows` rows and an id are free
        ([] when they are now); None when the evictable adapters not in `exclude` cannot make room."""
        free_rows, free_ids = self.rows.num_free, len(self._free_ids)
        out: list[str] = []
        candidates = (r for r in self.residents.values() if r.evictable and r.adapter not in exclude)
        for r in sorted(candidates, key=lambda r: r.last_used):
            if free_rows >= rows and free_ids:
                break
            out.append(r.adapter)
            free_rows += r.rows
            free_ids += 1
        return out if free_rows >= rows and free_ids else None

    def assign(
        self, adapter: str, rows: int, loading: bool = False, exclude: Collection[str] = ()
    ) -> tuple[Resident, list[str]]:
        """Make `adapter` resident in `rows` rows (evicting `victims(rows, exclude)`); returns it and the
        adapters evicted. It counts as just used, so a block copied for a request still waiting is not
        the next LRU victim."""
        if adapter in self.residents:
            raise RuntimeError(f"adapter {adapter!r} is already resident")
        evicted = self.victims(rows, exclude)
        if evicted is None:
            raise RuntimeError(f"no room for adapter {adapter!r} ({rows} rows) in the adapter pool")
        for name in evicted:
            self.evict(name)
        runs = self.rows.allocate(rows)
        assert runs is not None  # victims() counted the rows
        pinned_rows = sum(r.rows for r in self.residents.values() if r.pinned)
        pin = adapter in self.pinned and self.rows.total_rows - pinned_rows - rows >= self.max_rank
        pin = pin and (self.num_ids - sum(r.pinned for r in self.residents.values()) > 1)
        self._clock += 1
        res = Resident(adapter, heapq.heappop(self._free_ids), runs, 0, self._clock, pin, loading)
        self.residents[adapter] = self.by_id[res.lora_id] = res
        return res, evicted

    def evict(self, adapter: str) -> int | None:
        """Free `adapter`'s rows and id (it must be unreferenced); returns the id it had."""
        res = self.residents.get(adapter)
        if res is None:
            return None
        if res.refs:
            raise RuntimeError(f"adapter {adapter!r} has {res.refs} references; cannot evict")
        del self.residents[adapter], self.by_id[res.lora_id]
        self.rows.free(res.runs)
        heapq.heappush(self._free_ids, res.lora_id)
        return res.lora_id

    def mark_ready(self, lora_id: int) -> None:
        """The worker reported the id's copy complete: it may be a victim again once unreferenced."""
        res = self.by_id.get(lora_id)
        if res is not None:
            res.loading = False

    def acquire(self, lora_id: int) -> None:
        """A request uses the adapter (also while it is loading: the worker waits layer by layer)."""
        res = self.by_id[lora_id]
        self._clock += 1
        res.refs += 1
        res.last_used = self._clock

    def release(self, lora_id: int) -> None:
        res = self.by_id[lora_id]
        if res.refs <= 0:
            raise RuntimeError(f"adapter id {lora_id} released more often than acquired")
        res.refs -= 1
