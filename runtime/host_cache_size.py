"""How large the host cache (the adapter-loader's shared pool) is and how many threads fill it, from the
`lorapipe serve` arguments; checked up front so a cache that holds no adapter never starts."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.common.model_config import ModelConfig
    from runtime.serve_args import ServeArgs

DEFAULT_CPU_LORA_CACHE_GB = 4.0


def host_cache_bytes(args: ServeArgs, model_cfg: ModelConfig) -> int:
    """The host pool's size: --cpu-lora-cache-gb; else room for --max-cpu-loras blocks of --max-lora-rank
    (what that flag alone always meant); else DEFAULT_CPU_LORA_CACHE_GB. Whole 4 KiB pages."""
    from runtime.common.host_pool import ALIGN, pool_bytes_for
    from runtime.common.lora_layout import LoraLayout
    from runtime.common.model_config import serving_dtype_name

    if args.cpu_lora_cache_gb is None and args.max_cpu_loras is not None:
        layout = LoraLayout.for_model(model_cfg, args.max_lora_rank)
        dtype = serving_dtype_name(args.dtype, model_cfg.dtype)
        return pool_bytes_for(layout, args.max_lora_rank, dtype, args.max_cpu_loras)
    gib = DEFAULT_CPU_LORA_CACHE_GB if args.cpu_lora_cache_gb is None else args.cpu_lora_cache_gb
    return int(gib * 2**30) // ALIGN * ALIGN


def max_block_bytes(model_cfg: ModelConfig, max_rank: int, dtype: str) -> int:
    """The aligned bytes of one adapter block of rank `max_rank`: the most one host range must hold."""
    from runtime.common.host_pool import pool_bytes_for
    from runtime.common.lora_layout import LoraLayout
    from runtime.common.model_config import serving_dtype_name

    layout = LoraLayout.for_model(model_cfg, max_rank)
    return pool_bytes_for(layout, max_rank, serving_dtype_name(dtype, model_cfg.dtype), 1)


def default_loader_threads() -> int:
    """Half the cores, 2 to 8: one adapter's reads and copies spread over them."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


def loader_threads(args: ServeArgs) -> int:
    return default_loader_threads() if args.loader_threads is None else args.loader_threads


def default_loader_writers() -> int:
    """Half the cores up to 8 on a machine of 8 cores or more (where parts on threads, sharing one GIL, top
    out near 3 GB/s); none on a smaller one, whose threads suffice."""
    cores = os.cpu_count() or 2
    return min(8, cores // 2) if cores >= 8 else 0


def loader_writers(args: ServeArgs) -> int:
    return default_loader_writers() if args.loader_writers is None else args.loader_writers


def host_cache_problem(args: ServeArgs, model_cfg: ModelConfig) -> str | None:
    """Why the host cache cannot work (it holds no adapter of --max-lora-rank), or None."""
    from runtime.common.lora_layout import LoraLayout
    from runtime.common.model_config import serving_dtype_name

    block = LoraLayout.for_model(model_cfg, args.max_lora_rank).block_bytes(
        args.max_lora_rank, serving_dtype_name(args.dtype, model_cfg.dtype)
    )
    size = host_cache_bytes(args, model_cfg)
    if size >= block:
        return None
    return (
        f"--cpu-lora-cache-gb: {size} bytes hold no adapter of rank {args.max_lora_rank} "
        f"(--max-lora-rank): one takes {block} bytes ({block / 2**30:.3f} GiB)"
    )
