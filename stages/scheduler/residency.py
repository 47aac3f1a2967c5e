"""Where each waiting request's adapter stands and which pool loads to issue: demand placement at
admission, and prefetch of the adapters of the next `prefetch_depth` waiting requests into free rows or
rows no running or nearer waiting request needs. Plain CPU code over the PoolTable."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from enum import Enum

from proto.plan import SlotLoad
from stages.scheduler.pool_table import PoolTable


class Place(Enum):
    BASE = "base"  # no adapter
    RESIDENT = "resident"  # resident and settled: may run now
    LOADING = "loading"  # its copy is in flight: may run now, each layer waiting for its own copy
    LOAD = "load"  # rows can be freed for it: issue a load (the request may run in the same step)
    WAIT = "wait"  # not staged yet, or the pool cannot make room now


class Residency:
    """`adapter_ready(name)`: the adapter's host block can be copied into the pool now.
    `adapter_rows(name)`: the rank rows it takes (its largest rank).
    `overlapped(name)`: its load marks it loading until the worker reports it ready (it is then never a
    victim, and prefetch may issue it ahead of need); otherwise it is only loaded for the step that admits
    its requests (the right call for loads much cheaper than a step). Either way a request may run while
    its adapter is still being copied: the worker makes each layer wait for its own part."""

    def __init__(
        self,
        table: PoolTable,
        adapter_ready: Callable[[str], bool],
        adapter_rows: Callable[[str], int],
        overlapped: Callable[[str], bool],
        prefetch_depth: int,
    ):
        self.table = table
        self.adapter_ready = adapter_ready
        self.adapter_rows = adapter_rows
        self.overlapped = overlapped
        self.prefetch_depth = prefetch_depth
        self.loads_issued = 0

    def place(self, adapter: str | None, nearer: Collection[str] = ()) -> tuple[Place, int]:
        """Where `adapter` can run, with its id (-1 if none yet); with overlap a victim never holds an
        adapter in `nearer` (needed by a waiting request ahead of this one)."""
        if adapter is None:
            return Place.BASE, -1
        res = self.table.get(adapter)
        if res is not None:
            return (Place.LOADING if res.loading else Place.RESIDENT), res.lora_id
        if not self.adapter_ready(adapter):
            return Place.WAIT, -1
        victims = self.table.victims(self.adapter_rows(adapter), self._exclude(adapter, nearer))
        return (Place.WAIT, -1) if victims is None else (Place.LOAD, -1)

    def _exclude(self, adapter: str, nearer: Collection[str]) -> Collection[str]:
        return nearer if self.overlapped(adapter) else ()

    def issue(self, adapter: str, loads: list[SlotLoad], nearer: Collection[str] = ()) -> int:
        """Make `adapter` resident (after `place` said LOAD with the same `nearer`); returns its id."""
        return self._load(adapter, self._exclude(adapter, nearer), self.overlapped(adapter), loads)

    def warm(self, adapter: str, loads: list[SlotLoad]) -> bool:
        """Start-up warming: load `adapter` into free rows and a free id, never evicting (False when it is
        resident already or does not fit now). Marked loading until the worker reports the copy done."""
        if self.table.get(adapter) is not None or self.table.victims(self.adapter_rows(adapter)) != []:
            return False
        self._load(adapter, (), True, loads)
        return True

    def _load(self, adapter: str, exclude: Collection[str], overlapped: bool, loads: list[SlotLoad]) -> int:
        res, _ = self.table.assign(adapter, self.adapter_rows(adapter), loading=overlapped, exclude=exclude)
        loads.append(
            SlotLoad(
                slot=res.lora_id,
                adapter=adapter,
                layered=overlapped,
                row_starts=[s for s, _ in res.runs],
                row_counts=[n for _, n in res.runs],
            )
        )
        self.loads_issued += 1
        return res.lora_id

    def prefetch(self, waiting: Iterable[str | None], loads: list[SlotLoad]) -> None:
        """Issue loads for the adapters of the next `prefetch_depth` waiting requests (`waiting`: their
        adapters in queue order). Victims are first only adapters no request in the window needs, then
        any but those a running request (refs) or a nearer waiting request needs. Adapters cheap enough
        to load synchronously are left to admission: evicting for them only churns the pool."""
        window = [a for _, a in zip(range(self.prefetch_depth), waiting, strict=False)]
        wanted = {a for a in window if a is not None}
        nearer: set[str] = set()
        for adapter in window:
            if adapter is None:
                continue
            if not self.overlapped(adapter):
                nearer.add(adapter)
                continue
            if self.table.get(adapter) is None and self.adapter_ready(adapter):
                rows = self.adapter_rows(adapter)
                exclude = wanted if self.table.victims(rows, wanted) is not None else nearer
                if self.table.victims(rows, exclude) is None:
                    return  # the pool is in use or needed sooner
                self._load(adapter, exclude, True, loads)
            nearer.add(adapter)
