"""The scheduler stage's frozen config, composed by the launcher. KV page counts are not here: the
worker sizes its cache from free device memory and announces them (`WorkerStarted`)."""

from __future__ import annotations

import msgspec

from runtime.base.actor import StageConfig
from runtime.base.endpoints import Endpoints
from stages.scheduler.planner_config import PlannerPolicy


class SchedulerConfig(StageConfig, frozen=True, kw_only=True):
    endpoints: Endpoints
    # the host cache the scheduler places adapter blocks in: its bytes, the optional cap on blocks, and
    # the aligned bytes of a block of --max-lora-rank (what a first staging reserves: the rank of an
    # adapter is known only once the loader has read it)
    host_cache_bytes: int
    max_cpu_loras: int | None = None
    max_block_bytes: int
    # seconds a waiting request's adapter may make no progress (no tier change) before the request fails
    adapter_wait_timeout_s: float
    max_model_len: int
    # the planner's settings (runtime/engine_args.py derives them); the pool's size comes from the worker
    policy: PlannerPolicy = msgspec.field(default_factory=PlannerPolicy)
    adapters: dict[str, str] = {}  # name → path, registered at start (--adapter NAME=PATH)
    # plan ahead so the worker never waits on us: 3 when it overlaps steps (two on the device, one queued;
    # runtime/engine_args.plan_depths), 2 on its serial path
    max_plans_in_flight: int = 3
    # at light load (no request waiting, fewer than `light_below` running) keep this many instead (None:
    # the same): a new request's first plan then queues behind one plan less
    light_plans_in_flight: int | None = None
    light_below: int = 0


def plan_limit(cfg: SchedulerConfig, waiting: int, running: int) -> int:
    """Plans to keep at the worker now. A request that waits lifts the light-load limit, so its own plan
    is sent at once, behind the plans already there, instead of after one of them returns."""
    if cfg.light_plans_in_flight is not None and not waiting and running < cfg.light_below:
        return cfg.light_plans_in_flight
    return cfg.max_plans_in_flight
