"""The adapter-wait bound: a waiting request whose adapter has made no progress towards the GPU pool
(no tier change: staged, written, copied) for the timeout fails, naming the tier it waited on, instead
of waiting forever. Plain CPU code; the actor checks it on a tick that goes through its one handler."""

from __future__ import annotations

from stages.scheduler.adapters import AdapterRegistry, HostTier
from stages.scheduler.planner import PlannedRequest, Planner


class AdapterDeadlines:
    """The tick event (internal: it never crosses a socket)."""


def waiting_tier(planner: Planner, adapters: AdapterRegistry, adapter: str) -> tuple[str, float] | None:
    """Where a waiting request's adapter is held up, and since when; None when it is settled in the pool
    (the request then waits for batch room, not for its adapter)."""
    e = adapters.get(adapter)
    res = planner.pool.get(adapter)
    if e is None:
        return None
    if res is not None:
        return ("copy into the GPU adapter pool", e.since) if res.loading else None
    if e.host is HostTier.HOST:
        return "GPU adapter pool (no room)", e.since
    if e.host is HostTier.WRITING:
        return "adapter-loader (reading it from disk)", e.since
    return "host cache (no room to stage it)", e.since


def overdue_requests(
    planner: Planner, adapters: AdapterRegistry, timeout: float, now: float
) -> list[tuple[PlannedRequest, str]]:
    out = []
    for r in planner.waiting:
        if r.adapter is None:
            continue
        held = waiting_tier(planner, adapters, r.adapter)
        if held is not None and now - max(r.arrival, held[1]) >= timeout:
            out.append((r, held[0]))
    return out
