"""The one frozen configuration of a Ray Serve deployment of lorapipe, from `python -m runtime.ray_serve`'s
command line: the model, the adapter catalog, the replicas and their resources, and the `lorapipe serve`
flags every replica's server gets. Imports no Ray, so bad input is refused before a cluster is touched."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from runtime.ray_serve.catalog import AdapterCatalog, CatalogError

# Flags each replica sets for its own server: a user value would break the replica's wiring.
OWNED_SERVER_FLAGS = (
    "--model",
    "--device",
    "--served-model-name",
    "--endpoint",
    "--host",
    "--port",
    "--metrics-port",
    "--adapter",
    "--pin-adapter",
    "--no-runtime-adapter-loading",
    # the replica loads the catalog's adapters at runtime, wherever they are (its endpoints are private)
    "--adapter-root",
    "--allow-any-adapter-path",
)


class ClusterConfigError(ValueError):
    """A flag of `python -m runtime.ray_serve` is wrong; the message names it."""


@dataclass(frozen=True)
class ClusterConfig:
    model: str  # the base checkpoint directory, readable on every node
    catalog: AdapterCatalog
    served_model_name: str = ""  # the base model's `model` name ("" : the model directory's name)
    device: str = "cuda"
    num_replicas: int = 1
    max_adapters_per_replica: int = 64  # Ray's max_num_models_per_replica: LRU beyond it
    gpus_per_replica: float = 1.0  # 0 on the CPU
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 256  # per replica; more wait in Ray's router
    server_args: tuple[str, ...] = ()  # extra `lorapipe serve` flags
    ready_timeout_s: float = 900.0  # a server's start-up (weights, warm-up compiles, graphs)
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    retry_deadline_s: float = 120.0  # how long the ingress retries a request no replica could start
    # How long Ray's router waits for a replica's queue length before it counts that replica out for one
    # routing attempt (Ray's default: 0.1 s). A replica counted out this way loses its adapter's request to
    # a replica without the adapter, which then loads it and evicts another: far dearer for LoRA serving
    # than a late answer from a busy event loop.
    router_probe_deadline_s: float = 1.0
    max_body_bytes: int = 16 * 2**20
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "lorapipe"

    def __post_init__(self) -> None:
        self.check()

    @property
    def base_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def check(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ClusterConfigError(f"--model {self.model}: no config.json there")
        if self.device not in ("cuda", "cpu"):
            raise ClusterConfigError(f"--device {self.device!r}: use cuda or cpu")
        if self.num_replicas < 1:
            raise ClusterConfigError(f"--num-replicas {self.num_replicas}: at least 1")
        if self.max_adapters_per_replica < 1:
            n = self.max_adapters_per_replica
            raise ClusterConfigError(f"--max-adapters-per-replica {n}: at least 1")
        if self.device == "cuda" and self.gpus_per_replica <= 0:
            raise ClusterConfigError("--gpus-per-replica must be > 0 with --device cuda")
        if self.device == "cpu" and self.gpus_per_replica != 0:
            raise ClusterConfigError("--gpus-per-replica must be 0 with --device cpu")
        if self.cpus_per_replica < 0 or self.max_ongoing_requests < 1:
            raise ClusterConfigError("--cpus-per-replica must be >= 0 and --max-ongoing-requests >= 1")
        for arg in self.server_args:
            flag = arg.split("=", 1)[0]
            if flag in OWNED_SERVER_FLAGS:
                raise ClusterConfigError(f"server flag {flag}: each replica sets it itself; remove it")
        if not self.router_probe_deadline_s > 0:
            raise ClusterConfigError(f"--router-probe-deadline {self.router_probe_deadline_s}: must be > 0")
        if not 0 < self.port <= 65535:
            raise ClusterConfigError(f"--port {self.port}: not a port")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime.ray_serve",
        description="Serve lorapipe replicas under Ray Serve, one server per GPU, adapters multiplexed by "
        "name; an OpenAI-compatible ingress routes by `model`. Flags after `--` go to every replica's "
        "`lorapipe serve`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="base checkpoint directory (the same path on every node)")
    p.add_argument("--adapter-root", default=None, help="directory of PEFT adapters, served by dir name")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH", help="one more adapter")
    p.add_argument("--served-model-name", default="", help="the base model's name in `model`")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--num-replicas", type=int, default=1, help="lorapipe servers (one per GPU on cuda)")
    p.add_argument("--max-adapters-per-replica", type=int, default=64, help="Ray's LRU bound per replica")
    p.add_argument("--gpus-per-replica", type=float, default=None, help="default: 1 on cuda, 0 on cpu")
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--max-ongoing-requests", type=int, default=256, help="per replica")
    p.add_argument("--health-check-period", type=float, default=5.0, help="seconds")
    p.add_argument("--retry-deadline", type=float, default=120.0, help="seconds a request may be retried")
    p.add_argument(
        "--router-probe-deadline", type=float, default=1.0,
        help="seconds Ray's router waits for a replica's queue length before it routes elsewhere "
        "(Ray's own default 0.1 s sends requests away from their adapter's replica when it is busy)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP ingress")
    p.add_argument("--port", type=int, default=8000, help="port of the HTTP ingress")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="-- then `lorapipe serve` flags")
    return p


def from_args(ns: argparse.Namespace) -> ClusterConfig:
    """ClusterConfig from parsed flags; raises ClusterConfigError naming the wrong one."""
    server_args = list(ns.server_args)
    if server_args and server_args[0] == "--":
        server_args = server_args[1:]
    try:
        catalog = AdapterCatalog.build(ns.adapter, ns.adapter_root)
    except CatalogError as exc:
        raise ClusterConfigError(str(exc)) from None
    gpus = ns.gpus_per_replica if ns.gpus_per_replica is not None else (1.0 if ns.device == "cuda" else 0.0)
    return ClusterConfig(
        model=str(Path(ns.model).resolve()),
        catalog=catalog,
        served_model_name=ns.served_model_name,
        device=ns.device,
        num_replicas=ns.num_replicas,
        max_adapters_per_replica=ns.max_adapters_per_replica,
        gpus_per_replica=gpus,
        cpus_per_replica=ns.cpus_per_replica,
        max_ongoing_requests=ns.max_ongoing_requests,
        server_args=tuple(server_args),
        health_check_period_s=ns.health_check_period,
        retry_deadline_s=ns.retry_deadline,
        router_probe_deadline_s=ns.router_probe_deadline,
        host=ns.host,
        port=ns.port,
    )
