"""What the tokenizer checks before it forwards a client's adapter op: runtime loading switched on, the
adapter name rule, and the path confined to the adapter root (symlinks resolved), or any path only when
the server was started with --allow-any-adapter-path. A refused path gets one text whatever exists on
disk, so a client learns nothing about the server's files from it."""

from __future__ import annotations

import os

from proto.client import LoadAdapter, UnloadAdapter
from runtime.common.names import adapter_name_problem
from stages.tokenizer.validate import Rejected

MAX_PATH_CHARS = 4096


def confine(path: str, root: str | None) -> str | None:
    """The resolved path to read, or None when it lies outside `root` (already resolved). Relative
    paths are taken inside the root. Resolving follows symlinks only, so it costs no more, and says no
    more, for a path that does not exist than for one that does."""
    if root is None:
        return path
    real = os.path.realpath(os.path.join(root, path))
    return real if real == root or real.startswith(root.rstrip(os.sep) + os.sep) else None


def path_refused(name: str) -> str:
    """The one text of a refused LoadAdapter path (outside the root, or no root and no opt-in)."""
    return (
        f"adapter {name!r}: this server loads adapters at runtime only from inside its adapter root "
        "(--adapter-root DIR, or --allow-any-adapter-path to allow any path)"
    )


def check_adapter_op(
    msg: LoadAdapter | UnloadAdapter, *, runtime_loading: bool, adapter_root: str | None, allow_any_path: bool
) -> str | None:
    """Raise Rejected for an op this server refuses; for a LoadAdapter, the path to load (resolved
    inside the root; as given when any path is allowed)."""
    if not runtime_loading:
        raise Rejected(
            "forbidden",
            "this server does not load or unload adapters at runtime (--no-runtime-adapter-loading)",
        )
    problem = adapter_name_problem(msg.name)
    if problem is not None:
        raise Rejected("invalid_request", problem)
    if not isinstance(msg, LoadAdapter):
        return None
    if not msg.path or len(msg.path) > MAX_PATH_CHARS or "\0" in msg.path:
        raise Rejected("invalid_request", f"adapter {msg.name!r}: the path is empty, too long or holds a NUL")
    if adapter_root is None and not allow_any_path:
        raise Rejected("forbidden", path_refused(msg.name))
    real = confine(msg.path, adapter_root)
    if real is None:
        raise Rejected("forbidden", path_refused(msg.name))
    return real
