"""The host-cache holds of pool copies when a pipelined plan loads a pool id again before the worker
reported the copy an earlier plan issued there (its adapter's requests ended meanwhile, so the planner
could reuse the id): each report settles the oldest copy into that id, so neither adapter's block is
held forever, nor released before its own copy was reported."""

from __future__ import annotations

import asyncio

from proto.loader import AdapterStaged
from proto.plan import SlotError, SlotLoad
from runtime.base.actor import Mailbox
from runtime.base.metrics import StageMetrics
from stages.scheduler.adapter_lifecycle import AdapterLifecycle
from stages.scheduler.adapters import AdapterRegistry, HostTier
from stages.scheduler.host_table import HostTable
from stages.scheduler.metrics import SchedulerMetrics


async def _no_fail(request_id: str, kind: str, message: str) -> None:
    raise AssertionError(f"no request should fail here: {request_id} {kind} {message}")


def _lifecycle(names: list[str]) -> tuple[AdapterLifecycle, AdapterRegistry]:
    reg = AdapterRegistry({n: f"/adapters/{n}" for n in names})
    for i, n in enumerate(names):  # staged: packed in the host cache, so a pool load may copy it
        e = reg.entries[n]
        e.host = HostTier.HOST
        e.staged = AdapterStaged(name=n, shm_name="", offset=4096 * i, nbytes=4096, rank=4, layer_nbytes=2048)
    series = SchedulerMetrics(
        StageMetrics("scheduler"),
        planner=lambda: None,
        early_requests=lambda: 0,
        tier_counts=dict,
        waiting_tiers=dict,
        hold_counts=dict,
    )
    life = AdapterLifecycle(reg, HostTable(1 << 20), 4096, Mailbox("to_loader", 8), _no_fail, series, 1)
    return life, reg


def _load(slot: int, adapter: str, row: int) -> SlotLoad:
    return SlotLoad(slot=slot, adapter=adapter, row_starts=[row], row_counts=[4])


def test_each_report_of_a_reused_id_settles_the_oldest_copy():
    life, reg = _lifecycle(["x", "y"])
    life.issue_load(_load(3, "x", 0))
    life.issue_load(_load(3, "y", 4))  # the next plan, before x's copy was reported
    assert (reg.entries["x"].copies, reg.entries["y"].copies) == (1, 1)
    life.loads_ready([3], None)  # x's copy
    assert (reg.entries["x"].copies, reg.entries["y"].copies) == (0, 1)  # y's has not run: still held
    assert reg.entries["x"].evictable and not reg.entries["y"].evictable
    life.loads_ready([3], None)  # y's copy
    assert reg.copies() == 0 and not life.pool_loads
    life.loads_ready([3], None)  # a report of nothing in flight changes nothing
    assert reg.copies() == 0


def test_a_failed_copy_settles_its_own_adapter_on_a_reused_id():
    life, reg = _lifecycle(["x", "y"])
    life.issue_load(_load(5, "x", 0))
    life.issue_load(_load(5, "y", 4))
    asyncio.run(life.settle_loads([], [SlotError(slot=5, adapter="y", message="copy failed")], None))
    assert (reg.entries["x"].copies, reg.entries["y"].copies) == (1, 0)
    asyncio.run(life.settle_loads([5], [], None))
    assert reg.copies() == 0 and not life.pool_loads
