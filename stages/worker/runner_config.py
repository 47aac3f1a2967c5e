"""The model runner's frozen settings, part of the worker's config: importing them imports no torch,
so the launcher builds the worker's config before any process has imported it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str | None = None  # None/"auto": the checkpoint's dtype
    quantization: str | None = None  # "fp8": quantize the projections at load (engine_args.py)
    max_lora_rank: int = 64
    # GiB of the rank-paged adapter pool; None: 10% of free device memory before the KV cache is sized
    # (CUDA), 64 MiB elsewhere; at least one adapter of max_lora_rank (stages/worker/lora/pool.py)
    lora_gpu_memory_gb: float | None = None
    lora_dtype: str = "auto"  # the pool's rows: the model's dtype, or "fp8"/"int8" with scales (pool.py)
    lora_backend: str | None = None  # None: triton on CUDA, torch elsewhere
    attention_backend: str | None = None  # None: triton on CUDA, torch elsewhere
    pointwise_backend: str | None = None  # norms, rotary, activation; None: triton on CUDA, torch elsewhere
    page_size: int = 16
    num_pages: int | None = None  # None: fill gpu_memory_utilization on CUDA, cpu_kv_tokens on CPU
    gpu_memory_utilization: float = 0.85
    cpu_kv_tokens: int = 65536
    max_tokens_per_step: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the KV cache
    # Decode batches up to this size replay CUDA graphs (0: always eager; CUDA + Triton attention only)
    cuda_graph_max_batch: int = 0
    # Steps with prefill tokens, up to this many tokens, replay CUDA graphs per token-count bucket (0:
    # eager; CUDA only; full graphs with Triton attention, piecewise with the torch loop)
    cuda_graph_max_tokens: int = 0
    max_running_requests: int = 64  # sequences one step can hold (bounds the attention blocks)
    # Compile every kernel variant serving can reach before the first step (CUDA only; see warmup.py)
    warmup: bool = False
    # Adapters of at least this many bytes may be copied layer by layer beside the steps that use them
    # (overlapped loading, --overlap-min-mb); None: never. Where the pool's largest adapter reaches it,
    # full step graphs get layer-gated twins so that such steps replay too (step_graphs.py).
    layered_min_bytes: int | None = None
    disable_custom_all_reduce: bool = False  # tensor parallel: every sum through NCCL (tp/allreduce.py)
