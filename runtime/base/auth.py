"""The client endpoint's shared secret: reading it (`--api-key`, `--api-key-file`, `LORAPIPE_API_KEY`) and
deriving from it the CURVE key pairs of server and clients, so that only holders of the secret can
connect (ZAP checks the client key) and the traffic is encrypted. Owns no socket."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.utils.z85

API_KEY_ENV = "LORAPIPE_API_KEY"
MIN_KEY_CHARS = 16
MAX_KEY_FILE_BYTES = 4096


class ApiKeyError(ValueError):
    """The key (or its file) is unusable; the message says why without quoting the key."""


@dataclass(frozen=True)
class CurveKeys:
    """z85-encoded CURVE keys derived from one shared secret (both roles derive the same four)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def derive_curve_keys(api_key: str) -> CurveKeys:
    """Deterministic key pairs: a Curve25519 secret key is any 32 bytes, here a hash of the role and
    the secret, so a server and its clients agree on every key without exchanging any."""
    if not zmq.has("curve"):
        raise ApiKeyError("this libzmq has no CURVE support, so an API key cannot be enforced")
    pairs = []
    for role in (b"server", b"client"):
        secret = zmq.utils.z85.encode(
            hashlib.sha256(b"lorapipe-curve-v1\0" + role + b"\0" + api_key.encode()).digest()
        )
        pairs.append((zmq.curve_public(secret), secret))
    (spub, ssec), (cpub, csec) = pairs
    return CurveKeys(server_public=spub, server_secret=ssec, client_public=cpub, client_secret=csec)


def check_api_key(key: str, source: str) -> str:
    key = key.strip()
    if len(key) < MIN_KEY_CHARS:
        raise ApiKeyError(f"{source}: the API key must be at least {MIN_KEY_CHARS} characters")
    if not key.isprintable():
        raise ApiKeyError(f"{source}: the API key must be printable text")
    return key


def read_api_key_file(path: str | os.PathLike[str]) -> str:
    """The key in `path` (one line). The file must be a regular file no other user can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ApiKeyError(f"--api-key-file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ApiKeyError(f"--api-key-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise ApiKeyError(f"--api-key-file {path}: readable by other users (chmod 600 it)")
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ApiKeyError(f"--api-key-file {path}: larger than {MAX_KEY_FILE_BYTES} bytes")
    try:
        return check_api_key(data.decode(), f"--api-key-file {Path(path).name}")
    except UnicodeDecodeError:
        raise ApiKeyError(f"--api-key-file {path}: not UTF-8 text") from None
