"""`lorapipe serve` arguments: the flags in help groups (one function per group), their defaults and
parsing into `ServeArgs`. Checks (and `parse_serve_args`: parse, then check) live in `serve_checks`, the
stage configs made from them in `stage_configs`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import NoReturn

from runtime import http_args
from runtime.base.endpoints import DEFAULT_CLIENT_PORT, DEFAULT_ENDPOINT
from runtime.base.sockets import MAX_CLIENT_MSG_BYTES
from runtime.common.names import adapter_name_problem
from runtime.engine_args import EngineArgs
from runtime.host_cache_size import DEFAULT_CPU_LORA_CACHE_GB
from runtime.serve_loading_args import add_loading_arguments
from runtime.serve_model_args import add_model_arguments
from runtime.serve_security import add_security_arguments

DEFAULT_METRICS_PORT = DEFAULT_CLIENT_PORT + 1
LOG_LEVELS = ("debug", "info", "warning", "error")


class ServeArgsError(ValueError):
    """A `lorapipe serve` argument is wrong; the message says which and why."""


@dataclass(frozen=True)
class ServeArgs(EngineArgs):
    """`EngineArgs` (what the offline engine takes too) plus what only the server has."""

    adapters: tuple[tuple[str, str], ...] = ()  # (name, path), in command-line order
    max_cpu_loras: int | None = None  # an optional cap on adapters in the host cache
    cpu_lora_cache_gb: float | None = None  # the host cache in GiB (see host_cache_bytes)
    loader_threads: int | None = None  # None: min(8, max(2, cpu_count // 2))
    loader_writers: int | None = None  # None: min(8, cpu_count // 2) with 8 cores or more, else 0
    endpoint: str = DEFAULT_ENDPOINT
    metrics_port: int = DEFAULT_METRICS_PORT  # 0: any free port; -1: no metrics endpoint
    log_level: str = "info"
    log_file: str | None = None  # stage output goes here instead of the launcher's stderr
    startup_timeout_s: float = 600.0  # the worker loads weights before it is Ready
    drain_timeout_s: float = 30.0  # SIGTERM: how long open requests may take to finish
    # a waiting request fails once its adapter has made no progress (no tier change) for this long
    adapter_wait_timeout_s: float = 120.0
    compile_cache_dir: str | None = None  # None: $TRITON_CACHE_DIR, else the XDG cache dir
    profile_dir: str | None = None  # the worker's step profiler writes its trace here
    profile_steps: tuple[int, int] | None = None  # (steps before the window, steps in it)
    # OpenAI-compatible HTTP (served by the tokenizer stage)
    host: str = http_args.DEFAULT_HOST
    port: int = http_args.DEFAULT_PORT  # 0: no HTTP
    served_model_name: str | None = None  # None: the model directory's name
    # security and limits (add_security_arguments)
    adapter_root: str | None = None  # runtime loads only from inside this directory
    allow_any_adapter_path: bool = False  # without adapter_root: runtime loads from any path (else refused)
    runtime_adapter_loading: bool = True  # False: LoadAdapter/UnloadAdapter are refused
    api_key: str | None = None  # the shared secret clients must hold (CURVE on the client endpoint)
    api_key_file: str | None = None
    max_request_bytes: int = MAX_CLIENT_MSG_BYTES  # a client message bigger than this is refused
    max_prompt_bytes: int = 0  # 0: derived from the model (context x longest token)

    @property
    def adapter_paths(self) -> dict[str, str]:
        return dict(self.adapters)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default: appended as "(default: X)" unless the help already says it in words
    (flags whose default is None, i.e. decided at start-up, describe it themselves)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, naming the command and where its help is: the usage
    block argparse prints first (30 lines for `serve`) would bury the one line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every `lorapipe serve` flag, in help groups; each group's flags are added by one function."""
    d = ServeArgs(model="")
    for title, add in (
        ("model", add_model_arguments),
        ("adapters", _adapter_arguments),
        ("memory", _memory_arguments),
        ("batching", _batching_arguments),
        ("loading", add_loading_arguments),
        ("endpoints", _endpoint_arguments),
        ("start-up and logs", _process_arguments),
    ):
        add(p.add_argument_group(title), d)
    add_security_arguments(p, d)


def _adapter_arguments(g: argparse._ArgumentGroup, d: ServeArgs) -> None:
    g.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register a PEFT adapter directory under NAME, checked before the server is ready "
        "(repeatable; default: none)",
    )
    g.add_argument(
        "--pin-adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="keep this adapter in the GPU adapter pool once loaded (repeatable; default: none)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        metavar="R",
        default=d.max_lora_rank,
        help="largest adapter rank accepted",
    )
    g.add_argument(
        "--lora-backend",
        choices=("torch", "triton"),
        default=None,
        help="LoRA kernels (default: triton on cuda, torch on cpu)",
    )
    g.add_argument(
        "--attention-backend",
        choices=("torch", "triton"),
        default=None,
        help="paged attention: the Triton kernel or the torch loop (default: triton on cuda, torch on cpu)",
    )
    g.add_argument(
        "--pointwise-backend",
        choices=("torch", "triton"),
        default=None,
        help="RMSNorm (with the residual add), rotary + K/V write and the activation: one fused Triton "
        "kernel each, or the plain torch ops (default: triton on cuda, torch on cpu)",
    )


def _memory_arguments(g: argparse._ArgumentGroup, d: ServeArgs) -> None:
    g.add_argument(
        "--max-loras-per-batch",
        type=int,
        metavar="N",
        default=None,
        help="distinct adapters one step can use (default: as many as the GPU adapter pool holds)",
    )
    g.add_argument(
        "--lora-gpu-memory-gb",
        type=float,
        metavar="GB",
        default=None,
        help="GiB of GPU memory for adapters, paged by rank (an adapter of rank r takes r rank rows; "
        "default: 10%% of free device memory before the KV cache is sized, 64 MiB on cpu)",
    )
    g.add_argument(
        "--lora-dtype",
        choices=("auto", "fp8", "int8"),  # lora/pool.py LORA_DTYPES, checked in tests/runtime/test_defaults
        default=d.lora_dtype,
        help="the GPU adapter pool's rows: auto, the model's dtype (exact); fp8 (e4m3) or int8, with a "
        "scale per slice of each rank row, quantized on the GPU after each copy (half the pool bytes a "
        "step reads, twice the adapters a pool holds; host cache and disk unchanged)",
    )
    g.add_argument(
        "--cpu-lora-cache-gb",
        type=float,
        metavar="GB",
        default=None,
        help="the shared pinned host cache in GiB; an adapter takes its own rank's bytes (default: "
        f"room for --max-cpu-loras adapters of --max-lora-rank if given, else {DEFAULT_CPU_LORA_CACHE_GB:g})",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        metavar="N",
        default=None,
        help="cap on adapters in the host cache (default: none, its bytes bound it)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        default=None,
        help="longest prompt + output in tokens (default: the model's context, capped by the KV cache)",
    )
    g.add_argument("--page-size", type=int, metavar="N", default=d.page_size, help="KV cache tokens per page")
    g.add_argument(
        "--num-pages",
        type=int,
        metavar="N",
        default=None,
        help="KV cache pages (default: what free GPU memory holds; 64k tokens on cpu)",
    )


def _batching_arguments(g: argparse._ArgumentGroup, d: ServeArgs) -> None:
    g.add_argument(
        "--max-running-requests",
        type=int,
        metavar="N",
        default=d.max_running_requests,
        help="requests in the running batch at once; more wait in the queue",
    )
    g.add_argument(
        "--max-tokens-per-step",
        type=int,
        metavar="N",
        default=d.max_tokens_per_step,
        help="tokens one forward step computes (longer prefills are chunked to fit)",
    )
    g.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        metavar="N",
        default=None,
        help="decode batches up to N replay CUDA graphs captured at start-up "
        "(default: min(--max-running-requests, 256); 0: always eager)",
    )
    g.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        metavar="N",
        default=None,
        help="steps with prefill tokens, up to N tokens, replay CUDA graphs captured at start-up per "
        "token-count bucket (padded to the next bucket; full graphs with the Triton attention, piecewise "
        "around attention otherwise; default: min(8192, --max-tokens-per-step); 0: always eager)",
    )
    g.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=d.overlap_schedule,
        help="launch the next step before reading the tokens of the one on the GPU, with one more plan "
        "queued at the worker (off: the serial path, each step's tokens read before the next launch)",
    )
    g.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.prefix_caching,
        help="reuse the KV pages of prompt prefixes already computed with the same adapter (its same "
        "load) and the same tokens; cached pages are evicted, least recently used first, only when a "
        "request needs the room (--no-prefix-caching: every prompt is computed whole)",
    )
    g.add_argument(
        "--max-plans-in-flight",
        type=int,
        metavar="N",
        default=d.max_plans_in_flight,
        help="plans the scheduler keeps queued or running at the worker, at every load (default: 3 with "
        "--overlap-schedule, 2 while no request waits and fewer than an eighth of "
        "--max-running-requests run; 2 without); a new request's first step waits behind them",
    )


def _endpoint_arguments(g: argparse._ArgumentGroup, d: ServeArgs) -> None:
    g.add_argument(
        "--endpoint",
        metavar="ADDR",
        default=d.endpoint,
        help="client endpoint: tcp://HOST:PORT or ipc:///PATH",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        metavar="P",
        default=d.metrics_port,
        help="Prometheus /metrics on 127.0.0.1:P (0: any free port, -1: none)",
    )
    http_args.add_arguments(g)


def _process_arguments(g: argparse._ArgumentGroup, d: ServeArgs) -> None:
    g.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=d.warmup,
        help="compile every kernel variant serving can reach before reporting ready (cuda only)",
    )
    g.add_argument(
        "--compile-cache-dir",
        metavar="DIR",
        default=None,
        help="Triton's kernel cache, so that a restart skips compiling "
        "(default: $TRITON_CACHE_DIR, else $XDG_CACHE_HOME/lorapipe/triton or ~/.cache/lorapipe/triton)",
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        metavar="S",
        default=d.startup_timeout_s,
        help="seconds every stage has to become ready (weights, warm-up, graphs)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        default=d.drain_timeout_s,
        help="on SIGTERM, seconds open requests have to finish",
    )
    g.add_argument(
        "--adapter-wait-timeout",
        type=float,
        metavar="S",
        default=d.adapter_wait_timeout_s,
        help="a request fails once its adapter has made no progress towards the GPU for S seconds "
        "(the error names the tier it waited on)",
    )
    g.add_argument(
        "--profile-dir",
        metavar="DIR",
        default=None,
        help="profile some of the worker's steps with torch.profiler: a gzipped Chrome trace goes here and "
        "the log gives the window's GPU-busy share (default: no profiling)",
    )
    g.add_argument(
        "--profile-steps",
        metavar="START:COUNT",
        default=None,
        help=f"with --profile-dir, the steps to profile: COUNT steps from the START-th plan "
        f"(default: {DEFAULT_PROFILE_STEPS[0]}:{DEFAULT_PROFILE_STEPS[1]})",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default=d.log_level, help="launcher and stage logs")
    g.add_argument(
        "--log-file", metavar="PATH", default=None, help="write the stages' output here (default: stderr)"
    )


def from_namespace(ns: argparse.Namespace) -> ServeArgs:
    """ServeArgs from parsed arguments; raises ServeArgsError (nothing is checked on disk yet)."""
    fields = {f.name for f in dataclasses.fields(ServeArgs)}
    kw = {_RENAMED.get(k, k): v for k, v in vars(ns).items() if _RENAMED.get(k, k) in fields}
    kw["adapters"] = tuple(parse_adapter(a) for a in kw["adapters"])
    kw["pinned_adapters"] = tuple(kw["pinned_adapters"])
    kw["profile_steps"] = profile_window(kw.get("profile_dir"), kw.get("profile_steps"))
    return ServeArgs(**kw)


DEFAULT_PROFILE_STEPS = (100, 200)


def profile_window(profile_dir: str | None, spec: str | None) -> tuple[int, int] | None:
    """(START, COUNT) from `--profile-steps START:COUNT`; the default window with --profile-dir alone."""
    if spec is None:
        return DEFAULT_PROFILE_STEPS if profile_dir is not None else None
    if profile_dir is None:
        raise ServeArgsError("--profile-steps needs --profile-dir (where the trace goes)")
    start, sep, count = spec.partition(":")
    try:
        window = (int(start), int(count)) if sep else None
    except ValueError:
        window = None
    if window is None or window[0] < 0 or window[1] < 1:
        raise ServeArgsError(f"--profile-steps {spec!r}: expected START:COUNT, e.g. 100:200 (COUNT >= 1)")
    return window


_RENAMED = {  # argparse dest → ServeArgs field
    "adapter": "adapters",
    "pin_adapter": "pinned_adapters",
    "startup_timeout": "startup_timeout_s",
    "drain_timeout": "drain_timeout_s",
    "adapter_wait_timeout": "adapter_wait_timeout_s",
}


def parse_adapter(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ServeArgsError(f"--adapter {spec!r}: expected NAME=PATH")
    problem = adapter_name_problem(name)
    if problem is not None:
        raise ServeArgsError(f"--adapter {spec!r}: {problem}")
    return name, path
