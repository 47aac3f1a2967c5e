"""Churn-aware admission: requests whose adapter is resident may pass one whose adapter must load, but a
request whose adapter is staged is passed in at most `bypass_limit` steps. After that it is *due*: the
planner reserves for it what it needs and lets others pass only where they take none of that. The queue
is considered in `admission_order`: requests of adapters already in the step first, within an age bound.
Plain CPU code; the planner owns the queues, this decides their order and what the due request needs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from stages.scheduler.pool_table import PoolTable


@dataclass(frozen=True)
class Reservation:
    """What the due request needs kept: `blocked` adapters take no new requests but its own (their rows
    must come free, or one of them must leave the step for its adapter to fit the per-step bound), and
    `adapter` keeps one of the step's distinct-adapter places."""

    request_id: str
    adapter: str
    blocked: frozenset[str]


def admission_order(waiting: Iterable, step: int, step_adapters: set[str], affinity_steps: int) -> list:
    """The waiting queue in the order admission considers it. With adapter affinity (`affinity_steps` >
    0): requests queued `affinity_steps` planner steps ago or more (preempted ones among them) in queue
    order, then those whose adapter is already in the step (or that have none), then the rest, each
    part in queue order. A request's adapter rows are read once per step whatever the number of its
    requests there, so each admission that joins an adapter already in the step adds no adapter bytes
    to the steps that follow; the age bound keeps every other request's extra wait to that many steps."""
    if affinity_steps <= 0:
        return list(waiting)
    old, affine, rest = [], [], []
    for r in waiting:
        if step - r.queued_step >= affinity_steps:
            old.append(r)
        elif r.adapter is None or r.adapter in step_adapters:
            affine.append(r)
        else:
            rest.append(r)
    return old + affine + rest


class Admission:
    def __init__(
        self,
        table: PoolTable,
        adapter_rows: Callable[[str], int],
        max_loras_per_batch: int,
        bypass_limit: int,
    ):
        self.table = table
        self.adapter_rows = adapter_rows
        self.max_loras_per_batch = max_loras_per_batch
        self.bypass_limit = bypass_limit

    def reserve(
        self, waiting: Sequence, running: Sequence, ready: Callable[[str], bool]
    ) -> Reservation | None:
        """The reservation of the first waiting request passed `bypass_limit` times, if any."""
        due = next((r for r in waiting if r.adapter is not None and r.bypassed >= self.bypass_limit), None)
        if due is None or not (ready(due.adapter) or self.table.get(due.adapter) is not None):
            return None
        return Reservation(due.request_id, due.adapter, frozenset(self._blocked(due.adapter, running)))

    def _blocked(self, adapter: str, running: Sequence) -> set[str]:
        blocked: set[str] = set()
        if self.table.get(adapter) is None:
            # Rows and an id: unreferenced adapters first (least recently used), then the ones whose
            # running requests are fewest, until enough would be free once they drain.
            need, free_rows, free_ids = (
                self.adapter_rows(adapter),
                self.table.rows.num_free,
                self.table.free_ids,
            )
            others = [r for r in self.table.residents.values() if not r.pinned and r.adapter != adapter]
            for r in sorted(others, key=lambda r: (r.refs > 0 or r.loading, r.refs, r.last_used)):
                if free_rows >= need and free_ids:
                    break
                blocked.add(r.adapter)
                free_rows, free_ids = free_rows + r.rows, free_ids + 1
        in_step = Counter(r.adapter for r in running if r.adapter is not None)
        if adapter not in in_step and len(in_step) >= self.max_loras_per_batch:
            # A place among the step's distinct adapters: one running adapter must leave the step.
            blocked.add(min(in_step, key=lambda a: (a not in blocked, in_step[a], a)))
        return blocked

    @staticmethod
    def may_pass(res: Reservation | None, req, ahead: bool, place_is_load: bool) -> bool:
        """Whether `req` may be admitted while `res` holds: the due request itself always; others never
        onto a blocked adapter, and only requests ahead of it in the queue may load a new adapter."""
        if res is None or req.request_id == res.request_id:
            return True
        if req.adapter in res.blocked:
            return False
        return ahead or not place_is_load

    def distinct_room(self, res: Reservation | None, req, step_adapters: set[str]) -> bool:
        """Whether `req`'s adapter fits the step's distinct-adapter bound (keeping one place for the due
        request's adapter while a reservation holds)."""
        if req.adapter is None or req.adapter in step_adapters:
            return True
        keep = res is not None and req.request_id != res.request_id and res.adapter not in step_adapters
        return len(step_adapters) + int(keep) < self.max_loras_per_batch
