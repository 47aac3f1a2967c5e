"""The adapter-wait bound: a waiting request fails once its adapter has made no progress for the timeout,
counted from the later of its arrival and the adapter's last tier change, and the reason names the tier
it waited on; a request whose adapter is settled in the pool waits for batch room, not for its adapter."""

from __future__ import annotations

from proto.loader import AdapterStaged
from proto.sampling import SamplingParams
from stages.scheduler.adapter_waits import overdue_requests
from stages.scheduler.adapters import AdapterRegistry, HostTier
from stages.scheduler.planner import Planner, PlannerConfig
from tests.stages.scheduler.pool_worker import PLANNER_ALONE

TIMEOUT = 120.0


def _setup(now: list[float]):
    reg = AdapterRegistry({"a": "/a", "b": "/b"})
    cfg = PlannerConfig(
        num_pages=16,
        page_size=16,
        pool_rows=8,
        pool_ids=1,
        max_model_len=64,
        max_lora_rank=8,
        **PLANNER_ALONE,
    )
    planner = Planner(cfg, adapter_rows=reg.rows, adapter_ready=reg.ready, clock=lambda: now[0])
    return reg, planner


def _wait(planner: Planner, rid: str, adapter: str) -> None:
    planner.add(rid, [1, 2, 3], adapter, SamplingParams(max_tokens=2))


def test_each_tier_is_named_once_the_adapter_stalls():
    now = [0.0]
    reg, planner = _setup(now)
    _wait(planner, "r1", "a")
    assert overdue_requests(planner, reg, TIMEOUT, now=TIMEOUT - 1) == []
    ((req, tier),) = overdue_requests(planner, reg, TIMEOUT, now=TIMEOUT)
    assert req.request_id == "r1" and tier == "host cache (no room to stage it)"
    e = reg.get("a")
    e.host, e.since = HostTier.WRITING, 50.0  # progress at t=50: the clock restarts there
    assert overdue_requests(planner, reg, TIMEOUT, now=TIMEOUT + 10) == []
    ((_, tier),) = overdue_requests(planner, reg, TIMEOUT, now=50.0 + TIMEOUT)
    assert tier == "adapter-loader (reading it from disk)"
    e.host, e.since = HostTier.HOST, 200.0
    e.staged = AdapterStaged(name="a", shm_name="p", offset=0, nbytes=64, rank=8, layer_nbytes=32)
    ((_, tier),) = overdue_requests(planner, reg, TIMEOUT, now=200.0 + TIMEOUT)
    assert tier == "GPU adapter pool (no room)"


def test_a_late_arrival_and_a_settled_adapter_are_not_overdue():
    now = [500.0]
    reg, planner = _setup(now)
    _wait(planner, "late", "b")  # its adapter has sat on disk since t=0, the request came at t=500
    assert overdue_requests(planner, reg, TIMEOUT, now=500.0 + TIMEOUT - 1) == []
    assert [r.request_id for r, _ in overdue_requests(planner, reg, TIMEOUT, now=500.0 + TIMEOUT)] == ["late"]
    e = reg.get("b")
    e.host = HostTier.HOST
    e.staged = AdapterStaged(name="b", shm_name="p", offset=0, nbytes=64, rank=8, layer_nbytes=32)
    planner.pool.assign("b", 8)  # resident and settled: the request waits for batch room only
    assert overdue_requests(planner, reg, TIMEOUT, now=10_000.0) == []
    planner.pool.get("b").loading = True  # its copy never completes: that is the adapter stalling
    ((_, tier),) = overdue_requests(planner, reg, TIMEOUT, now=10_000.0)
    assert tier == "copy into the GPU adapter pool"
