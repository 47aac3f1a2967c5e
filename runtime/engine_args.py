"""What `lorapipe serve` and the offline engine (`runtime.offline.LLM`) share, and the one place the
engine's configs are derived from it: the runner's config, the planner's policy, the context length,
the CUDA-graph batch and token bounds and the serving dtype. Every engine knob and its default is
defined here once: `ServeArgs` extends `EngineArgs` and its flags take these defaults, `LLM(**kwargs)`
takes these names, and the planner's policy copies them by name. tests/runtime/test_defaults.py fails on
any other default or name, and lists what the worker's and planner's own configs still call or default
otherwise for their unit tests (the engine always sets those fields from here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-importing modules load lazily: `lorapipe --help` stays fast
    from runtime.common.model_config import ModelConfig
    from stages.scheduler.planner_config import PlannerPolicy
    from stages.worker.runner_config import RunnerConfig


@dataclass(frozen=True)
class EngineArgs:
    model: str
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str = "auto"
    # "fp8": the linear projections in fp8 e4m3, one scale per output channel (a bf16 checkpoint is
    # quantized at load); None: as the checkpoint stores them (an fp8 checkpoint runs in fp8)
    quantization: str | None = None
    max_loras_per_batch: int | None = None  # distinct adapters in one step; None: as many as the pool holds
    lora_gpu_memory_gb: float | None = None  # the GPU adapter pool; None: see RunnerConfig
    # the GPU adapter pool's rows: "auto" in the model's dtype (exact PEFT parity), "fp8" (e4m3) or "int8"
    # with a scale per slice of each rank row (half the bytes a step reads; host cache and disk unchanged)
    lora_dtype: str = "auto"
    max_adapter_bypass: int = 16  # steps a request whose adapter is staged may be passed
    # Steps a waiting request may be passed by requests of adapters already in the step (0: queue
    # order). With 1,000 Zipf-popular adapters in a burst, 200 gives a median TTFT about 10 % lower than
    # queue order at the same throughput; nothing changes while the queue is short.
    adapter_affinity_steps: int = 200
    max_lora_rank: int = 64
    max_running_requests: int = 64
    max_tokens_per_step: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by a known KV size
    page_size: int = 16
    num_pages: int | None = None
    lora_backend: str | None = None  # None: triton on cuda, torch on cpu
    attention_backend: str | None = None  # None: triton on cuda, torch on cpu
    pointwise_backend: str | None = None  # norms, rotary, activation; None: triton on cuda, torch on cpu
    pinned_adapters: tuple[str, ...] = ()
    overlap_loading: bool = True  # pool loads run beside steps that do not need them
    prefetch_depth: int = 8  # waiting requests looked ahead at for pool loads (0: off)
    # Smaller adapters are neither prefetched into the pool (that only churns it) nor copied layer by
    # layer: their copy is waited for whole on the stream. A mix of adapters of up to 90 MB ran 24 %
    # faster at 128 than at 64 while a layer-by-layer copy made its step eager; steps with such copies
    # now replay layer-gated graphs, and the threshold is worth measuring again.
    overlap_min_mb: float = 128.0
    cuda_graph_max_batch: int | None = None  # None: min(max_running_requests, 256); 0: no CUDA graphs
    # steps with prefill tokens up to N tokens replay CUDA graphs; None: min(max_tokens_per_step, 8192)
    cuda_graph_max_tokens: int | None = None
    seed: int = 0
    # launch step N+1 before reading step N's tokens (off: the serial path, kept for comparison)
    overlap_schedule: bool = True
    # plans the scheduler keeps at the worker at every load; None: the default depths (plan_depths)
    max_plans_in_flight: int | None = None
    warmup: bool = True  # compile every reachable kernel variant before ready (CUDA; nothing on CPU)
    # ranks the model and its adapters are sharded over, one process and one GPU each (stages/worker/tp/)
    tensor_parallel_size: int = 1
    # sum small tensor-parallel messages through NCCL too, not through NVLink peer memory (allreduce.py)
    disable_custom_all_reduce: bool = False
    # reuse the KV pages of prompt prefixes already computed for the same adapter (off: every prompt whole)
    prefix_caching: bool = True

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        from runtime.common.cuda_driver import cuda_device_count  # no torch: the launcher resolves it

        return "cuda" if cuda_device_count() > 0 else "cpu"


def context_length(e: EngineArgs, model_cfg: ModelConfig) -> int:
    """max_model_len, else the model's context capped by the KV cache when its size is known before
    start-up (on CUDA without num_pages the worker sizes it from free memory, and caps it then)."""
    if e.max_model_len is not None:
        return e.max_model_len
    from stages.worker.runner_config import RunnerConfig

    kv_tokens = None
    if e.num_pages is not None:
        kv_tokens = e.num_pages * e.page_size
    elif e.resolved_device() == "cpu":
        kv_tokens = RunnerConfig(model_dir=e.model).cpu_kv_tokens
    limit = model_cfg.max_position_embeddings
    return min(limit, kv_tokens) if kv_tokens else limit


def graph_batch(e: EngineArgs) -> int:
    """Largest decode batch replayed as a CUDA graph (never more than can run at once)."""
    if e.cuda_graph_max_batch is None:
        return min(e.max_running_requests, 256)
    return min(e.cuda_graph_max_batch, e.max_running_requests)


# Steps of up to this many tokens replay graphs by default: the eager forward is host-bound, with many
# distinct adapters most of all (1B-shaped model, 8,192-token steps, 1,000 adapters of mixed ranks:
# graphs up to 8,192 tokens against 2,048 run base-only 13 % faster and the adapter mix 33 % faster).
# The largest bucket sets the graph pool's size and the capture time (both logged at start-up: 794 MiB
# and 2.3 s there, against 368 MiB).
DEFAULT_GRAPH_TOKENS = 8192


def graph_tokens(e: EngineArgs) -> int:
    """Largest step with prefill tokens replayed as a CUDA graph (never more than one step computes)."""
    if e.cuda_graph_max_tokens is None:
        return min(e.max_tokens_per_step, DEFAULT_GRAPH_TOKENS)
    return min(e.cuda_graph_max_tokens, e.max_tokens_per_step)


def plan_depths(e: EngineArgs) -> dict[str, int | None]:
    """The scheduler's plan-depth settings (SchedulerConfig's fields). With overlapped scheduling it keeps
    one plan more than the two steps on the device, so that a plan is already queued when a step's result
    is read and the GPU never waits for the scheduler's round trip; serial, 2. Each plan queued ahead of a
    new request's first plan is a step its first token waits for, so overlapped with the default depth it
    keeps 2 while no request waits and fewer than an eighth of --max-running-requests run: light-load
    TTFT then waits behind one step less, where a saturated batch keeps the third plan (a depth fixed at
    2 costs up to 22 % of throughput). An explicit --max-plans-in-flight holds at every load."""
    if e.max_plans_in_flight is not None:
        return dict(max_plans_in_flight=e.max_plans_in_flight, light_plans_in_flight=None, light_below=0)
    if not e.overlap_schedule:
        return dict(max_plans_in_flight=2, light_plans_in_flight=None, light_below=0)
    light_below = max(1, e.max_running_requests // 8)
    return dict(max_plans_in_flight=3, light_plans_in_flight=2, light_below=light_below)


def serving_dtype(e: EngineArgs, model_cfg: ModelConfig) -> str:
    """The dtype every stage uses ("auto": the checkpoint's)."""
    from runtime.common.model_config import serving_dtype_name

    return serving_dtype_name(e.dtype, model_cfg.dtype)


def runner_config(e: EngineArgs, model_cfg: ModelConfig) -> RunnerConfig:
    from stages.worker.runner_config import RunnerConfig

    return RunnerConfig(
        model_dir=e.model,
        device=e.resolved_device(),
        dtype=serving_dtype(e, model_cfg),
        quantization=e.quantization,
        max_lora_rank=e.max_lora_rank,
        lora_gpu_memory_gb=e.lora_gpu_memory_gb,
        lora_dtype=e.lora_dtype,
        lora_backend=e.lora_backend,
        attention_backend=e.attention_backend,
        pointwise_backend=e.pointwise_backend,
        page_size=e.page_size,
        num_pages=e.num_pages,
        max_tokens_per_step=e.max_tokens_per_step,
        max_model_len=context_length(e, model_cfg),
        cuda_graph_max_batch=graph_batch(e),
        cuda_graph_max_tokens=graph_tokens(e),
        max_running_requests=e.max_running_requests,
        warmup=e.warmup,
        layered_min_bytes=int(e.overlap_min_mb * 2**20) if e.overlap_loading else None,
        disable_custom_all_reduce=e.disable_custom_all_reduce,
    )


def planner_policy(e: EngineArgs) -> PlannerPolicy:
    """What the planner is told before the worker reports the KV cache and adapter pool it has: each of
    its fields is the engine knob of that name (a knob cannot be renamed on the way down)."""
    from stages.scheduler.planner_config import PlannerPolicy

    knobs = {name: getattr(e, name) for name in PlannerPolicy.__struct_fields__}
    knobs["pinned_adapters"] = tuple(dict.fromkeys(e.pinned_adapters))
    return PlannerPolicy(**knobs)
