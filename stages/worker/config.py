"""The gpu-worker stage's frozen config, composed by the launcher."""

from __future__ import annotations

from runtime.base.actor import StageConfig
from runtime.base.endpoints import Endpoints
from stages.worker.runner_config import RunnerConfig


class WorkerConfig(StageConfig, frozen=True, kw_only=True):
    endpoints: Endpoints
    runner: RunnerConfig  # model, device, dtype, slots, max rank, backend, KV cache sizing
    max_model_len: int
    host_pool_name: str  # the shared-memory host cache the loader packs adapters into
    host_pool_bytes: int
    seed: int = 0
    overlap_loading: bool = True  # a slot copy stalls only the steps that use the slot
    overlap_schedule: bool = True  # launch the next queued plan before reading a step's tokens
    tensor_parallel_size: int = 1  # ranks 1..N-1 are processes this stage starts (stages/worker/tp/)
    profile_dir: str | None = None  # where the step profiler writes its trace (--profile-dir)
    profile_steps: tuple[int, int] | None = None  # (plans launched before the window, steps in it)
