"""The adapter-loader stage's frozen config, composed by the launcher."""

from __future__ import annotations

from runtime.base.actor import StageConfig
from runtime.base.endpoints import Endpoints


class LoaderConfig(StageConfig, frozen=True, kw_only=True):
    endpoints: Endpoints
    model_dir: str  # adapters are validated against this base model
    dtype: str | None  # the model's serving dtype (None: the checkpoint's); adapters are converted to it
    max_lora_rank: int
    host_pool_name: str  # shared memory created by the launcher (it outlives a loader restart)
    host_pool_bytes: int  # the host cache's capacity: blocks take their own rank's bytes
    load_threads: int = 2  # loads at once (and, without writers, the threads reading and packing them)
    writers: int = 0  # part-writer processes reading and packing (0: the threads do)
    max_adapter_file_bytes: int = 8 << 30  # adapter_model.safetensors larger than this is refused
    read_timeout_s: float = 120.0  # from opening an adapter's tensor file to its last byte read
    adapter_root: str | None = None  # resolved; adapters are read only from inside it (or trusted_paths)
    trusted_paths: tuple[str, ...] = ()  # resolved dirs of the --adapter adapters
