"""Checks of `lorapipe serve` arguments before anything is spawned, each failing with one line that
names the flag: paths, numbers, device, endpoints and busy ports, and every --adapter read with the
adapter-loader's own code."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from runtime import http_args
from runtime.host_cache_size import host_cache_problem
from runtime.serve_args import (
    ArgumentParser,
    HelpFormatter,
    ServeArgs,
    ServeArgsError,
    add_serve_arguments,
    from_namespace,
)
from runtime.serve_security import SecurityArgsError, check_security

if TYPE_CHECKING:
    from runtime.common.model_config import ModelConfig


def parse_serve_args(argv: Sequence[str]) -> ServeArgs:
    """Parse and validate `lorapipe serve` arguments (argparse exits on syntax; ServeArgsError after)."""
    parser = ArgumentParser(prog="lorapipe serve", formatter_class=HelpFormatter)
    add_serve_arguments(parser)
    args = from_namespace(parser.parse_args(list(argv)))
    validate(args)
    return args


def validate(args: ServeArgs) -> ModelConfig:
    """Check everything that can be checked before spawning; returns the model's config."""
    from runtime.common.model_config import ModelConfig as _ModelConfig
    from runtime.common.model_config import ModelConfigError

    model = Path(args.model)
    problem = _directory_problem(model)
    if problem is None and not (model / "config.json").is_file():
        problem = "no config.json (expected a Hugging Face checkpoint directory)"
        if (model / "adapter_config.json").is_file():
            problem += "; this is a PEFT adapter: give it with --adapter NAME=DIR"
    if problem is not None:
        raise ServeArgsError(f"--model {args.model}: {problem}")
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
        problem = _directory_problem(Path(path))
        if problem is None and not (Path(path) / "adapter_config.json").is_file():
            problem = "no adapter_config.json (not a PEFT adapter directory)"
        if problem is not None:
            raise ServeArgsError(f"--adapter {name}={path}: {problem}")
    for name in args.pinned_adapters:
        if name not in seen:
            raise ServeArgsError(f"--pin-adapter {name}: no --adapter registers that name")
    _check_numbers(args, model_cfg)
    _check_device(args)
    _check_quantization(args, model_cfg)
    _check_endpoint(args.endpoint)
    try:
        check_security(args)
    except SecurityArgsError as exc:
        raise ServeArgsError(str(exc)) from None
    _check_ports(args)
    check_adapters(args, model_cfg)
    return model_cfg


def _directory_problem(path: Path) -> str | None:
    """Why `path` is no directory to read a model or an adapter from, or None."""
    if not path.exists():
        return "no such directory"
    if not path.is_dir():
        return "not a directory"
    return None


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
        ("--adapter-wait-timeout", args.adapter_wait_timeout_s),
        ("--max-plans-in-flight", args.max_plans_in_flight),
        ("--tensor-parallel-size", args.tensor_parallel_size),
    ]:
        if value is not None and value <= 0:
            raise ServeArgsError(f"{flag} must be positive, got {value}")
    if problem := host_cache_problem(args, model_cfg):
        raise ServeArgsError(problem)
    for flag, value in [
        ("--adapter-affinity-steps", args.adapter_affinity_steps),
        ("--overlap-min-mb", args.overlap_min_mb),
        ("--loader-writers", args.loader_writers),
        ("--cuda-graph-max-batch", args.cuda_graph_max_batch),
        ("--cuda-graph-max-tokens", args.cuda_graph_max_tokens),
        ("--prefetch-depth", args.prefetch_depth),
        ("--drain-timeout", args.drain_timeout_s),
    ]:
        if value is not None and value < 0:
            raise ServeArgsError(f"{flag} must not be negative, got {value}")
    http_args.check(args.port, args.served_model_name, ServeArgsError)
    if not -1 <= args.metrics_port <= 65535:
        raise ServeArgsError(f"--metrics-port {args.metrics_port}: not a port (0: any free port, -1: none)")
    _check_tensor_parallel(args, model_cfg)
    if args.max_model_len is not None and args.max_model_len > model_cfg.max_position_embeddings:
        raise ServeArgsError(
            f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
            f"{model_cfg.max_position_embeddings}"
        )


def _check_tensor_parallel(args: ServeArgs, model_cfg: ModelConfig) -> None:
    """N must divide the heads, KV heads and MLP width; on CUDA, N GPUs must be there."""
    n = args.tensor_parallel_size
    if n <= 1:
        return
    from runtime.common.model_config import ModelConfigError, check_divisible

    try:
        check_divisible(model_cfg, n)
    except ModelConfigError as exc:
        raise ServeArgsError(f"--tensor-parallel-size {n}: {exc}") from None
    if args.resolved_device() == "cuda":
        from runtime.common.cuda_driver import cuda_device_count

        if cuda_device_count() < n:
            raise ServeArgsError(
                f"--tensor-parallel-size {n}: only {cuda_device_count()} CUDA devices are visible"
            )


def _check_device(args: ServeArgs) -> None:
    device = args.resolved_device()
    if device == "cuda":
        from runtime.common.cuda_driver import cuda_device_count

        if cuda_device_count() == 0:
            raise ServeArgsError("--device cuda: no CUDA device is available")
    kernels = (("--lora-backend", args.lora_backend), ("--pointwise-backend", args.pointwise_backend))
    for flag, name in kernels:
        if name == "triton" and device != "cuda":
            raise ServeArgsError(f"{flag} triton needs --device cuda")


def _check_quantization(args: ServeArgs, model_cfg: ModelConfig) -> None:
    """fp8 weights (asked for, or the checkpoint's) need a GPU that runs fp8 GEMMs and bf16 activations:
    the capability from the driver, not torch (each worker also runs one fp8 GEMM when it starts)."""
    if args.quantization is None and model_cfg.quantization is None:
        return
    if args.resolved_device() != "cuda":
        return
    from runtime.common.cuda_driver import compute_capability
    from runtime.common.model_config import serving_dtype_name
    from runtime.common.quant_config import fp8_device_problem

    capability = compute_capability(0)  # "cuda": the device the worker (TP rank 0) runs on
    dtype = serving_dtype_name(args.dtype, model_cfg.dtype)
    if capability is not None and (problem := fp8_device_problem(capability, dtype)):
        flag = "--quantization fp8" if args.quantization else f"--model {args.model}"
        raise ServeArgsError(f"{flag}: {problem}")


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


def _check_ports(args: ServeArgs) -> None:
    """A port another program listens on is refused now, in one line, not by a stage after spawning."""
    if args.metrics_port > 0:
        _probe_tcp("--metrics-port", str(args.metrics_port), "127.0.0.1", args.metrics_port)
    if args.port > 0:
        _probe_tcp("--port", str(args.port), args.host, args.port)
    ep = args.endpoint
    if ep.startswith("tcp://"):
        host, _, port = ep[len("tcp://") :].rpartition(":")
        if int(port) > 0:
            _probe_tcp("--endpoint", ep, "0.0.0.0" if host == "*" else host.strip("[]"), int(port))
    elif ep.startswith("ipc://"):
        path = ep[len("ipc://") :]
        if Path(path).is_socket():
            with socket.socket(socket.AF_UNIX) as s, contextlib.suppress(OSError):
                s.connect(path)
                raise ServeArgsError(f"--endpoint {ep}: a running server listens on that socket")


def _probe_tcp(flag: str, shown: str, host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ServeArgsError(f"{flag} {shown}: cannot resolve {host!r} ({exc.strerror or exc})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ and http.server bind
        try:
            s.bind(addr)
        except OSError as exc:
            why = "already in use (another server on that port?)" if exc.errno == errno.EADDRINUSE else None
            raise ServeArgsError(f"{flag} {shown}: {why or f'cannot bind: {exc.strerror}'}") from None


def check_adapters(args: ServeArgs, model_cfg: ModelConfig) -> None:
    """Check every --adapter with the adapter-loader's own code (config, tensor names, shapes and dtypes
    from the safetensors header, rank against --max-lora-rank), so that a bad one stops the start with
    the message a runtime load would give, instead of failing its first request. No tensor data is read
    (thousands of adapters start in seconds); values are checked when an adapter is first loaded. Imports
    no torch (`adapter_check`), so the stages are spawned without waiting for one."""
    if not args.adapters:
        return
    from concurrent.futures import ThreadPoolExecutor

    from runtime.common.lora_layout import LoraLayout
    from stages.loader.adapter_check import check_adapter
    from stages.loader.adapter_config import AdapterError

    layout = LoraLayout.for_model(model_cfg, args.max_lora_rank)

    def check(name: str, path: str) -> str | None:
        try:
            check_adapter(name, path, model_cfg, layout)
        except AdapterError as exc:
            return f"--adapter {name}={path}: {exc}"
        return None

    with ThreadPoolExecutor(max_workers=min(8, len(args.adapters))) as pool:
        errors = [e for e in pool.map(lambda a: check(*a), args.adapters) if e]
    if errors:
        more = f" (and {len(errors) - 1} more --adapter errors)" if len(errors) > 1 else ""
        raise ServeArgsError(errors[0] + more)
