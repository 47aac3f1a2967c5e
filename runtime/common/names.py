"""The one rule for adapter names, used by the command line, the wire (tokenizer and scheduler), the
SDK and the offline engine: 1-128 characters, letters, digits, '.', '_', '-', starting with a letter
or digit (so never a path, an empty string, or a control character)."""

from __future__ import annotations

import re

MAX_ADAPTER_NAME = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")
RULE = f"1-{MAX_ADAPTER_NAME} letters, digits, '.', '_' or '-', starting with a letter or digit"


def adapter_name_problem(name: object) -> str | None:
    """Why `name` is not a valid adapter name (None: it is)."""
    if not isinstance(name, str):
        return f"an adapter name must be a string, got {type(name).__name__}"
    if len(name) > MAX_ADAPTER_NAME or not _NAME.fullmatch(name):
        shown = repr(name[:40]) + ("..." if len(name) > 40 else "")
        return f"adapter name {shown} is invalid: use {RULE}"
    return None


def check_adapter_name(name: object) -> str:
    """`name` if valid, else ValueError saying what the rule is."""
    problem = adapter_name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name  # type: ignore[return-value]
