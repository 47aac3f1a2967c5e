"""The four frozen stage configs (tokenizer, scheduler, gpu-worker, adapter-loader) composed from
checked `lorapipe serve` arguments (the engine-wide values come from `engine_args`, as for the offline
engine), and the compile cache directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from runtime import http_args
from runtime.base.endpoints import Endpoints
from runtime.engine_args import (
    context_length,
    plan_depths,
    planner_policy,
    runner_config,
    serving_dtype,
)
from runtime.host_cache_size import loader_threads, loader_writers, max_block_bytes
from runtime.serve_args import ServeArgs
from runtime.serve_security import real_path, resolved_api_key, trusted_adapter_paths

if TYPE_CHECKING:
    from runtime.base.actor import StageConfig
    from runtime.common.model_config import ModelConfig


def compile_cache_dir(args: ServeArgs) -> str:
    """Where Triton keeps compiled kernels: --compile-cache-dir, else $TRITON_CACHE_DIR, else the XDG
    cache directory (~/.cache/lorapipe/triton)."""
    if args.compile_cache_dir:
        return str(Path(args.compile_cache_dir).expanduser().resolve())
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "lorapipe" / "triton")


def stage_configs(
    args: ServeArgs, model_cfg: ModelConfig, endpoints: Endpoints, pool_name: str, pool_bytes: int
) -> dict[str, StageConfig]:
    """The four frozen stage configs, keyed by stage name."""
    from stages.loader.config import LoaderConfig
    from stages.scheduler.config import SchedulerConfig
    from stages.tokenizer.config import TokenizerConfig
    from stages.worker.config import WorkerConfig

    common: dict[str, Any] = {"control": endpoints.control, "endpoints": endpoints}
    context = context_length(args, model_cfg)
    dtype = serving_dtype(args, model_cfg)
    pool = {"host_pool_name": pool_name, "host_pool_bytes": pool_bytes}
    tokenizer = TokenizerConfig.from_model_dir(
        args.model,
        adapters=tuple(name for name, _ in args.adapters),
        **http_args.tokenizer_fields(args),
        max_client_msg_bytes=args.max_request_bytes,
        max_prompt_bytes=args.max_prompt_bytes,
        api_key=resolved_api_key(args),
        adapter_root=real_path(args.adapter_root),
        allow_any_adapter_path=args.allow_any_adapter_path,
        runtime_adapter_loading=args.runtime_adapter_loading,
        **common,
    )
    runner = runner_config(args, model_cfg)
    return {
        "tokenizer": msgspec.structs.replace(
            tokenizer, max_model_len=context, drain_timeout_s=args.drain_timeout_s
        ),
        "scheduler": SchedulerConfig(
            max_cpu_loras=args.max_cpu_loras,
            host_cache_bytes=pool_bytes,
            max_block_bytes=max_block_bytes(model_cfg, args.max_lora_rank, dtype),
            adapter_wait_timeout_s=args.adapter_wait_timeout_s,
            max_model_len=context,
            policy=planner_policy(args),
            adapters=args.adapter_paths,
            **plan_depths(args),
            **common,
        ),
        "worker": WorkerConfig(
            runner=runner,
            max_model_len=context,
            seed=args.seed,
            overlap_loading=args.overlap_loading,
            overlap_schedule=args.overlap_schedule,
            tensor_parallel_size=args.tensor_parallel_size,
            profile_dir=args.profile_dir,
            profile_steps=args.profile_steps,
            **pool,
            **common,
        ),
        "loader": LoaderConfig(
            model_dir=args.model,
            dtype=dtype,
            max_lora_rank=args.max_lora_rank,
            adapter_root=real_path(args.adapter_root),
            trusted_paths=trusted_adapter_paths(args),
            load_threads=loader_threads(args),
            writers=loader_writers(args),
            **pool,
            **common,
        ),
    }
