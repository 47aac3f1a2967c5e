"""The adapter-loader stage's frozen config, composed by the launcher."""

from __future__ import annotations

from runtime.base.actor import StageConfig
from runtime.base.endpoints import Endpoints


class LoaderConfig(StageConfig, frozen=True, kw_only=True):
    endpoints: Endpoints
    model_dir: str  # adapters are validated against this base model
    dtype: str | None  # the model's serving dtype (None: the checkpoint's); adapters are converted to it
    max_lora_rank: int
    max_cpu_loras: int  # host-cache capacity in adapters
    host_pool_name: str  # shared memory created by the launcher (it outlives a loader restart)
    host_pool_bytes: int
    load_threads: int = 2  # adapters read and packed at once
    adapter_root: str | None = None  # resolved; adapters are read only from inside it (or trusted_paths)
    trusted_paths: tuple[str, ...] = ()  # resolved dirs of the --adapter adapters
    read_timeout_s: float = 60.0  # one adapter's files must be read within this (else: failed, stuck)
