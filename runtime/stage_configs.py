"""The four frozen stage configs (tokenizer, scheduler, gpu-worker, adapter-loader) composed from
checked `lorapipe serve` arguments, and the values derived on the way (context length, dtype, graphs,
compile cache directory)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from runtime import http_args
from runtime.base.endpoints import Endpoints
from runtime.host_cache_size import loader_threads
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


def max_model_len(args: ServeArgs, model_cfg: ModelConfig) -> int:
    """--max-model-len, else the model's context capped by the KV cache when its size is known here
    (on CUDA without --num-pages the worker sizes it from free memory, after start-up)."""
    if args.max_model_len is not None:
        return args.max_model_len
    from stages.worker.runner import RunnerConfig

    kv_tokens = None
    if args.num_pages is not None:
        kv_tokens = args.num_pages * args.page_size
    elif args.resolved_device() == "cpu":
        kv_tokens = RunnerConfig(model_dir=args.model).cpu_kv_tokens
    limit = model_cfg.max_position_embeddings
    return min(limit, kv_tokens) if kv_tokens else limit


def cuda_graph_max_batch(args: ServeArgs) -> int:
    """Largest decode batch replayed as a CUDA graph (never more than can run at once)."""
    if args.cuda_graph_max_batch is None:
        return min(args.max_running_requests, 256)
    return min(args.cuda_graph_max_batch, args.max_running_requests)


def serving_dtype(args: ServeArgs, model_cfg: ModelConfig) -> str:
    """The dtype every stage uses, resolved once here ("auto" → the checkpoint's)."""
    from runtime.common.host_pool import dtype_name
    from runtime.common.model_config import parse_dtype

    return dtype_name(parse_dtype(args.dtype, model_cfg.dtype))


def stage_configs(
    args: ServeArgs, model_cfg: ModelConfig, endpoints: Endpoints, pool_name: str, pool_bytes: int
) -> dict[str, StageConfig]:
    """The four frozen stage configs, keyed by stage name."""
    from stages.loader.config import LoaderConfig
    from stages.scheduler.config import SchedulerConfig
    from stages.tokenizer.config import TokenizerConfig
    from stages.worker.config import WorkerConfig
    from stages.worker.runner import RunnerConfig

    common: dict[str, Any] = {"control": endpoints.control, "endpoints": endpoints}
    context = max_model_len(args, model_cfg)
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
        runtime_adapter_loading=args.runtime_adapter_loading,
        **common,
    )
    runner = RunnerConfig(
        model_dir=args.model,
        device=args.resolved_device(),
        dtype=dtype,
        max_lora_rank=args.max_lora_rank,
        lora_gpu_memory_gb=args.lora_gpu_memory_gb,
        lora_backend=args.lora_backend,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_tokens_per_step=args.max_tokens_per_step,
        max_model_len=context,
        cuda_graph_max_batch=cuda_graph_max_batch(args),
        max_running_requests=args.max_running_requests,
        warmup=args.warmup,
    )
    return {
        "tokenizer": msgspec.structs.replace(
            tokenizer, max_model_len=context, drain_timeout_s=args.drain_timeout_s
        ),
        "scheduler": SchedulerConfig(
            max_loras_per_batch=args.max_loras_per_batch,
            max_cpu_loras=args.max_cpu_loras,
            max_model_len=context,
            max_running_requests=args.max_running_requests,
            max_tokens_per_step=args.max_tokens_per_step,
            adapters=args.adapter_paths,
            pinned_adapters=tuple(dict.fromkeys(args.pinned_adapters)),
            overlap_loading=args.overlap_loading,
            prefetch_depth=args.prefetch_depth,
            overlap_min_bytes=int(args.overlap_min_mb * 2**20),
            bypass_limit=args.max_adapter_bypass,
            **common,
        ),
        "worker": WorkerConfig(
            runner=runner,
            max_model_len=context,
            seed=args.seed,
            overlap_loading=args.overlap_loading,
            **pool,
            **common,
        ),
        "loader": LoaderConfig(
            model_dir=args.model,
            dtype=dtype,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            adapter_root=real_path(args.adapter_root),
            trusted_paths=trusted_adapter_paths(args),
            load_threads=loader_threads(args),
            **pool,
            **common,
        ),
    }
