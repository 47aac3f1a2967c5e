"""`lorapipe serve`'s security and limit flags (one argument group): the adapter root, runtime loading,
the API key and its file, message and prompt size limits, and their checks before anything starts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.base.auth import API_KEY_ENV, ApiKeyError, check_api_key, read_api_key_file

if TYPE_CHECKING:
    from runtime.serve_args import ServeArgs


class SecurityArgsError(ValueError):
    """A security or limit flag is wrong (serve_args reports it as a ServeArgsError)."""


def add_security_arguments(p: argparse.ArgumentParser, d: ServeArgs) -> None:
    """Access control and request limits, in their own help group (`d`: the defaults)."""
    g = p.add_argument_group("security and limits")
    g.add_argument(
        "--adapter-root",
        metavar="DIR",
        default=None,
        help="runtime loads (load_adapter, /v1/load_lora_adapter) read only adapters inside DIR (symlinks "
        "resolved); relative paths are taken inside DIR (default: none, and runtime loads are refused "
        "unless --allow-any-adapter-path)",
    )
    g.add_argument(
        "--allow-any-adapter-path",
        action="store_true",
        default=d.allow_any_adapter_path,
        help="let runtime loads read any directory the server can read (instead of --adapter-root); "
        "--adapter adapters given at start-up are read wherever they are either way",
    )
    g.add_argument(
        "--runtime-adapter-loading",
        action=argparse.BooleanOptionalAction,
        default=d.runtime_adapter_loading,
        help="allow clients to load and unload adapters (--no-runtime-adapter-loading: only --adapter)",
    )
    key = g.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help=f"shared secret every client must hold (SDK: api_key= or ${API_KEY_ENV}); the endpoint then "
        "uses CURVE encryption and HTTP needs `Authorization: Bearer KEY`. Visible in the process list: "
        "prefer --api-key-file (default: none, no key required)",
    )
    key.add_argument(
        "--api-key-file",
        metavar="PATH",
        default=None,
        help="read the API key from a 0600 file (default: none)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        metavar="N",
        default=d.max_request_bytes,
        help="largest client message; a bigger one is refused before it is decoded",
    )
    g.add_argument(
        "--max-prompt-bytes",
        type=int,
        metavar="N",
        default=d.max_prompt_bytes,
        help="longest text prompt in UTF-8 bytes, checked before tokenizing "
        "(default 0: the context length times the longest token, which no shorter prompt can exceed)",
    )


def check_security(args: ServeArgs) -> None:
    if args.adapter_root is not None and not Path(args.adapter_root).is_dir():
        raise SecurityArgsError(f"--adapter-root {args.adapter_root}: not a directory")
    if args.adapter_root is not None and args.allow_any_adapter_path:
        raise SecurityArgsError("give --adapter-root or --allow-any-adapter-path, not both")
    if args.api_key is not None and args.api_key_file is not None:
        raise SecurityArgsError("give --api-key or --api-key-file, not both")
    try:
        resolved_api_key(args)
    except ApiKeyError as exc:
        raise SecurityArgsError(str(exc)) from None
    if args.max_request_bytes < 1024:
        raise SecurityArgsError(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    if args.max_prompt_bytes < 0:
        raise SecurityArgsError(f"--max-prompt-bytes must not be negative, got {args.max_prompt_bytes}")


def resolved_api_key(args: ServeArgs) -> str | None:
    """The key from --api-key or --api-key-file (checked), or None when clients need none."""
    if args.api_key_file is not None:
        return read_api_key_file(args.api_key_file)
    if args.api_key is not None:
        return check_api_key(args.api_key, "--api-key")
    return None


def trusted_adapter_paths(args: ServeArgs) -> tuple[str, ...]:
    """Resolved dirs of the --adapter adapters: the loader reads these even outside --adapter-root."""
    return tuple(os.path.realpath(path) for _, path in args.adapters)


def real_path(path: str | None) -> str | None:
    return os.path.realpath(path) if path is not None else None
