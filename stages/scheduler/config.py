"""The scheduler stage's frozen config, composed by the launcher. KV page counts are not here: the
worker sizes its cache from free device memory and announces them (`WorkerStarted`)."""

from __future__ import annotations

from runtime.base.actor import StageConfig
from runtime.base.endpoints import Endpoints


class SchedulerConfig(StageConfig, frozen=True, kw_only=True):
    endpoints: Endpoints
    max_loras_per_batch: int | None = None  # distinct adapters in one step (None: as many as the pool
    # holds); the GPU pool's size comes from the worker
    max_cpu_loras: int | None = (
        None  # host-cache cap, if any: the scheduler never holds more blocks than this
    )
    max_model_len: int
    max_running_requests: int = 64
    max_tokens_per_step: int = 2048
    adapters: dict[str, str] = {}  # name → path, registered at start (--adapter NAME=PATH)
    pinned_adapters: tuple[str, ...] = ()  # --pin-adapter: never evicted from the GPU pool once loaded
    max_plans_in_flight: int = 2  # plan step N+1 while step N runs; never let the worker wait on us
    overlap_loading: bool = True  # loads go out without the requests that need them (see Planner)
    prefetch_depth: int = 8  # waiting requests looked ahead at for pool loads (0: off)
    overlap_min_bytes: int = 64 << 20  # smaller pool loads stay synchronous even with overlap on
    bypass_limit: int = 16  # steps a request with a staged adapter may be passed (--max-adapter-bypass)
