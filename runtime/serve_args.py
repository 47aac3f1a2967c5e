"""`lorapipe serve` arguments: parsing, up-front validation with clear errors, and the composition of
the four frozen stage configs (tokenizer, scheduler, gpu-worker, adapter-loader) from them."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from runtime import http_args
from runtime.base.endpoints import DEFAULT_CLIENT_PORT, Endpoints
from runtime.base.sockets import MAX_CLIENT_MSG_BYTES
from runtime.common.names import adapter_name_problem
from runtime.host_cache_size import DEFAULT_CPU_LORA_CACHE_GB, host_cache_problem, loader_threads
from runtime.serve_security import (
    SecurityArgsError,
    add_security_arguments,
    check_security,
    real_path,
    resolved_api_key,
    trusted_adapter_paths,
)

if TYPE_CHECKING:  # torch-importing modules load lazily: `lorapipe --help` stays fast
    from runtime.base.actor import StageConfig
    from runtime.common.model_config import ModelConfig

DEFAULT_ENDPOINT = f"tcp://127.0.0.1:{DEFAULT_CLIENT_PORT}"
DEFAULT_METRICS_PORT = DEFAULT_CLIENT_PORT + 1
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ServeArgsError(ValueError):
    """A `lorapipe serve` argument is wrong; the message says which and why."""


@dataclass(frozen=True)
class ServeArgs:
    model: str
    adapters: tuple[tuple[str, str], ...] = ()  # (name, path), in command-line order
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str = "auto"
    max_loras_per_batch: int | None = None  # distinct adapters in one step; None: as many as the pool holds
    lora_gpu_memory_gb: float | None = None  # the GPU adapter pool; None: see RunnerConfig
    max_adapter_bypass: int = 16  # steps a request whose adapter is staged may be passed
    max_cpu_loras: int | None = None  # an optional cap on adapters in the host cache
    cpu_lora_cache_gb: float | None = None  # the host cache in GiB (see host_cache_bytes)
    loader_threads: int | None = None  # None: min(8, max(2, cpu_count // 2))
    max_lora_rank: int = 64
    max_running_requests: int = 64
    max_tokens_per_step: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by a known KV size
    page_size: int = 16
    num_pages: int | None = None
    lora_backend: str | None = None  # None: triton on cuda, torch on cpu
    attention_backend: str | None = None  # None: triton on cuda, torch on cpu
    pinned_adapters: tuple[str, ...] = ()
    overlap_loading: bool = True  # slot loads run beside steps that do not need them
    prefetch_depth: int = 8  # waiting requests looked ahead at for slot loads (0: off)
    overlap_min_mb: float = 64.0  # smaller adapters are not prefetched into slots (only churns them)
    cuda_graph_max_batch: int | None = None  # None: min(max_running_requests, 256); 0: no CUDA graphs
    endpoint: str = DEFAULT_ENDPOINT
    metrics_port: int = DEFAULT_METRICS_PORT  # 0: any free port; -1: no metrics endpoint
    log_level: str = "info"
    log_file: str | None = None  # stage output goes here instead of the launcher's stderr
    startup_timeout_s: float = 600.0  # the worker loads weights before it is Ready
    drain_timeout_s: float = 30.0  # SIGTERM: how long open requests may take to finish
    seed: int = 0
    # OpenAI-compatible HTTP (served by the tokenizer stage)
    host: str = http_args.DEFAULT_HOST
    port: int = http_args.DEFAULT_PORT  # 0: no HTTP
    served_model_name: str | None = None  # None: the model directory's name
    # security and limits (add_security_arguments)
    adapter_root: str | None = None  # runtime loads only from inside this directory
    runtime_adapter_loading: bool = True  # False: LoadAdapter/UnloadAdapter are refused
    api_key: str | None = None  # the shared secret clients must hold (CURVE on the client endpoint)
    api_key_file: str | None = None
    max_request_bytes: int = MAX_CLIENT_MSG_BYTES  # a client message bigger than this is refused
    max_prompt_bytes: int = 0  # 0: derived from the model (context x longest token)

    @property
    def adapter_paths(self) -> dict[str, str]:
        return dict(self.adapters)

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = ServeArgs(model="")
    p.add_argument(
        "--model", required=True, metavar="DIR", help="Hugging Face checkpoint directory of the base model"
    )
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH", help="register an adapter")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="serving dtype (auto: the checkpoint's)")
    p.add_argument(
        "--max-loras-per-batch",
        type=int,
        metavar="N",
        default=None,
        help="distinct adapters in one step (default: as many as the GPU adapter pool holds)",
    )
    p.add_argument(
        "--lora-gpu-memory-gb",
        type=float,
        metavar="GB",
        default=None,
        help="GiB of GPU memory for adapters, paged by rank (an adapter of rank r takes r rank rows); "
        "default: 10%% of free device memory before the KV cache is sized (64 MiB on CPU)",
    )
    p.add_argument(
        "--max-adapter-bypass",
        type=int,
        metavar="N",
        default=d.max_adapter_bypass,
        help="steps in which later requests may be admitted before one whose adapter is staged; then "
        "the scheduler reserves room for its adapter (bounds every adapter wait)",
    )
    # host cache (adapter-loader): sized in bytes, each adapter taking its own rank's share
    p.add_argument(
        "--cpu-lora-cache-gb",
        type=float,
        metavar="GB",
        default=None,
        help="host cache size in GiB; an adapter takes its own rank's bytes (default: room for "
        f"--max-cpu-loras adapters of --max-lora-rank if that is given, else {DEFAULT_CPU_LORA_CACHE_GB:g})",
    )
    p.add_argument(
        "--max-cpu-loras", type=int, metavar="N", default=None, help="cap on adapters in the host cache"
    )
    p.add_argument(
        "--loader-threads",
        type=int,
        metavar="N",
        default=None,
        help="threads reading adapters, one adapter's chunks spread over all (default: cores / 2, 2 to 8)",
    )
    p.add_argument("--max-lora-rank", type=int, metavar="R", default=d.max_lora_rank)
    p.add_argument("--max-running-requests", type=int, metavar="N", default=d.max_running_requests)
    p.add_argument("--max-tokens-per-step", type=int, metavar="N", default=d.max_tokens_per_step)
    p.add_argument(
        "--max-model-len", type=int, metavar="N", default=None, help="default: the model's context length"
    )
    p.add_argument("--page-size", type=int, metavar="N", default=d.page_size, help="KV cache tokens per page")
    p.add_argument(
        "--num-pages", type=int, metavar="N", default=None, help="KV cache pages (default: sized from memory)"
    )
    p.add_argument("--lora-backend", choices=("torch", "triton"), default=None)
    p.add_argument(
        "--attention-backend",
        choices=("torch", "triton"),
        default=None,
        help="paged attention: the Triton kernel (default on CUDA) or the torch loop (default on CPU)",
    )
    p.add_argument(
        "--pin-adapter", action="append", default=[], metavar="NAME", help="keep in the GPU pool once loaded"
    )
    p.add_argument(
        "--overlap-loading",
        action=argparse.BooleanOptionalAction,
        default=d.overlap_loading,
        help="copy adapters into slots beside steps that do not use them (off: the step waits)",
    )
    p.add_argument(
        "--prefetch-depth",
        type=int,
        metavar="N",
        default=d.prefetch_depth,
        help="waiting requests looked ahead at for slot loads (0: off)",
    )
    p.add_argument(
        "--overlap-min-mb",
        type=float,
        metavar="MB",
        default=d.overlap_min_mb,
        help="adapters smaller than this are not prefetched into slots, only loaded for the step that "
        "needs them (0: prefetch all)",
    )
    p.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        metavar="N",
        default=None,
        help="decode batches up to N replay CUDA graphs captured at start-up "
        "(default: min(--max-running-requests, 256); 0: always eager)",
    )
    p.add_argument(
        "--endpoint",
        metavar="ADDR",
        default=d.endpoint,
        help="client endpoint: tcp://HOST:PORT or ipc:///PATH",
    )
    p.add_argument(
        "--metrics-port", type=int, metavar="P", default=d.metrics_port, help="0: any free port, -1: none"
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default=d.log_level)
    p.add_argument("--log-file", metavar="PATH", default=None, help="write the stages' output here")
    p.add_argument("--startup-timeout", type=float, metavar="S", default=d.startup_timeout_s)
    p.add_argument("--drain-timeout", type=float, metavar="S", default=d.drain_timeout_s)
    p.add_argument("--seed", type=int, metavar="N", default=d.seed)
    http_args.add_arguments(p)
    add_security_arguments(p, d)


def from_namespace(ns: argparse.Namespace) -> ServeArgs:
    """ServeArgs from parsed arguments; raises ServeArgsError (nothing is checked on disk yet)."""
    fields = {f.name for f in dataclasses.fields(ServeArgs)}
    kw = {_RENAMED.get(k, k): v for k, v in vars(ns).items() if _RENAMED.get(k, k) in fields}
    kw["adapters"] = tuple(parse_adapter(a) for a in kw["adapters"])
    kw["pinned_adapters"] = tuple(kw["pinned_adapters"])
    return ServeArgs(**kw)


_RENAMED = {  # argparse dest → ServeArgs field
    "adapter": "adapters",
    "pin_adapter": "pinned_adapters",
    "startup_timeout": "startup_timeout_s",
    "drain_timeout": "drain_timeout_s",
}


def parse_serve_args(argv: Sequence[str]) -> ServeArgs:
    """Parse and validate `lorapipe serve` arguments (argparse exits on syntax; ServeArgsError after)."""
    parser = argparse.ArgumentParser(prog="lorapipe serve")
    add_serve_arguments(parser)
    args = from_namespace(parser.parse_args(list(argv)))
    validate(args)
    return args


def parse_adapter(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ServeArgsError(f"--adapter {spec!r}: expected NAME=PATH")
    problem = adapter_name_problem(name)
    if problem is not None:
        raise ServeArgsError(f"--adapter {spec!r}: {problem}")
    return name, path


def validate(args: ServeArgs) -> ModelConfig:
    """Check everything that can be checked before spawning; returns the model's config."""
    from runtime.common.model_config import ModelConfig as _ModelConfig
    from runtime.common.model_config import ModelConfigError

    model = Path(args.model)
    if not model.is_dir():
        raise ServeArgsError(f"--model {args.model}: not a directory")
    try:
        model_cfg = _ModelConfig.from_dir(model)
    except (ModelConfigError, KeyError, TypeError) as exc:
        raise ServeArgsError(f"--model {args.model}: {exc}") from None
    if not (model / "tokenizer.json").is_file():
        raise ServeArgsError(f"--model {args.model}: no tokenizer.json")
    seen: set[str] = set()
    for name, path in args.adapters:
        if name in seen:
            raise ServeArgsError(f"--adapter {name}: the name is given twice")
        seen.add(name)
        if not (Path(path) / "adapter_config.json").is_file():
            raise ServeArgsError(f"--adapter {name}={path}: no adapter_config.json (not a PEFT adapter)")
    for name in args.pinned_adapters:
        if name not in seen:
            raise ServeArgsError(f"--pin-adapter {name}: no --adapter registers that name")
    _check_numbers(args, model_cfg)
    _check_device(args)
    _check_endpoint(args.endpoint)
    try:
        check_security(args)
    except SecurityArgsError as exc:
        raise ServeArgsError(str(exc)) from None
    return model_cfg


def _check_numbers(args: ServeArgs, model_cfg: ModelConfig) -> None:
    for flag, value in [
        ("--max-loras-per-batch", args.max_loras_per_batch),
        ("--max-cpu-loras", args.max_cpu_loras),
        ("--lora-gpu-memory-gb", args.lora_gpu_memory_gb),
        ("--max-adapter-bypass", args.max_adapter_bypass),
        ("--cpu-lora-cache-gb", args.cpu_lora_cache_gb),
        ("--loader-threads", args.loader_threads),
        ("--max-lora-rank", args.max_lora_rank),
        ("--max-running-requests", args.max_running_requests),
        ("--max-tokens-per-step", args.max_tokens_per_step),
        ("--page-size", args.page_size),
        ("--num-pages", args.num_pages),
        ("--max-model-len", args.max_model_len),
        ("--startup-timeout", args.startup_timeout_s),
    ]:
        if value is not None and value <= 0:
            raise ServeArgsError(f"{flag} must be positive, got {value}")
    if problem := host_cache_problem(args, model_cfg):
        raise ServeArgsError(problem)
    if args.overlap_min_mb < 0:
        raise ServeArgsError(f"--overlap-min-mb must not be negative, got {args.overlap_min_mb}")
    if args.cuda_graph_max_batch is not None and args.cuda_graph_max_batch < 0:
        raise ServeArgsError(f"--cuda-graph-max-batch must not be negative, got {args.cuda_graph_max_batch}")
    if args.prefetch_depth < 0:
        raise ServeArgsError(f"--prefetch-depth must not be negative, got {args.prefetch_depth}")
    if args.drain_timeout_s < 0:
        raise ServeArgsError(f"--drain-timeout must not be negative, got {args.drain_timeout_s}")
    http_args.check(args.port, args.served_model_name, ServeArgsError)
    if not -1 <= args.metrics_port <= 65535:
        raise ServeArgsError(f"--metrics-port {args.metrics_port}: not a port (0: any free port, -1: none)")
    if args.max_model_len is not None and args.max_model_len > model_cfg.max_position_embeddings:
        raise ServeArgsError(
            f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
            f"{model_cfg.max_position_embeddings}"
        )


def _check_device(args: ServeArgs) -> None:
    device = args.resolved_device()
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ServeArgsError("--device cuda: no CUDA device is available")
    if args.lora_backend == "triton" and device != "cuda":
        raise ServeArgsError("--lora-backend triton needs --device cuda")


def _check_endpoint(endpoint: str) -> None:
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ServeArgsError(f"--endpoint {endpoint}: expected tcp://HOST:PORT")
    elif endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not path or len(path) > 107:
            raise ServeArgsError(f"--endpoint {endpoint}: expected ipc:///PATH (at most 107 bytes)")
        if not Path(path).parent.is_dir():
            raise ServeArgsError(f"--endpoint {endpoint}: directory {Path(path).parent} does not exist")
    else:
        raise ServeArgsError(f"--endpoint {endpoint}: expected tcp://HOST:PORT or ipc:///PATH")


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
