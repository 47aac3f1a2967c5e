"""`lorapipe serve` flags of the OpenAI-compatible HTTP endpoint (served by the tokenizer stage): their
parser group, their checks and the tokenizer config fields they become."""

from __future__ import annotations

import argparse
import re
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
_SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/]*")  # no ':' (it separates base:adapter)


def add_arguments(g: argparse._ArgumentGroup) -> None:
    """The HTTP flags, into the "endpoints" help group."""
    g.add_argument("--host", default=DEFAULT_HOST, help="address the OpenAI-compatible HTTP server binds")
    g.add_argument(
        "--port",
        type=int,
        metavar="P",
        default=DEFAULT_PORT,
        help="HTTP port: /v1/*, /health, /metrics (0: none)",
    )
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the base model's name in the API's `model` field (default: the model directory's name)",
    )


def check(port: int, served_model_name: str | None, error: type[Exception]) -> None:
    """Raise `error` naming the flag that is wrong."""
    if not 0 <= port <= 65535:
        raise error(f"--port {port}: not a port (0: no HTTP server)")
    if served_model_name is not None and not _SERVED_NAME.fullmatch(served_model_name):
        raise error(f"--served-model-name {served_model_name!r}: use letters, digits, '.', '_', '-', '/'")


def tokenizer_fields(args: Any) -> dict[str, Any]:
    """The tokenizer config's HTTP fields from ServeArgs (model_name only with --served-model-name)."""
    out: dict[str, Any] = {"http_host": args.host, "http_port": args.port}
    if args.served_model_name is not None:
        out["model_name"] = args.served_model_name
    return out
