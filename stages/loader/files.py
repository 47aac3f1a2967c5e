"""Opening adapter files safely: only regular files (a FIFO or device never blocks a loader thread,
since the open itself does not wait), a size cap checked before reading, reads bounded by a deadline,
and the confinement of a load to the adapter root."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import BinaryIO

READ_CHUNK = 1 << 20


class FileRefused(OSError):
    """A file that is not read: not a regular file, too large, too slow, or outside the root. The
    message names the file by its base name only."""


def open_regular_fd(path: str | os.PathLike[str], max_bytes: int) -> tuple[int, int]:
    """(fd, size) of a regular file of at most `max_bytes`, checked on the open descriptor (no race with
    a swapped path). O_NONBLOCK makes opening a FIFO return at once; the descriptor is made blocking
    again for the reads. FileNotFoundError passes through; anything else refused is FileRefused."""
    name = Path(path).name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise FileRefused(f"{name}: cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"{name} is not a regular file")
        if st.st_size > max_bytes:
            raise FileRefused(f"{name} is {st.st_size} bytes, more than the limit of {max_bytes}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def open_regular(path: str | os.PathLike[str], max_bytes: int) -> BinaryIO:
    """`open_regular_fd` as a binary file object."""
    fd, _ = open_regular_fd(path, max_bytes)
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike[str], max_bytes: int, deadline_s: float) -> bytes:
    """The whole file, read in chunks; refused past `max_bytes` (it may grow while read) or when the
    read is still going after `deadline_s` seconds."""
    name = Path(path).name
    end = time.monotonic() + deadline_s
    chunks, size = [], 0
    with open_regular(path, max_bytes) as f:
        while chunk := f.read(min(READ_CHUNK, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise FileRefused(f"{name} grew past the {max_bytes} bytes allowed while it was read")
            if time.monotonic() > end:
                raise FileRefused(f"reading {name} took longer than {deadline_s:g}s")
    return b"".join(chunks)


def inside_root(path: str | os.PathLike[str], root: str | None, trusted: tuple[str, ...] = ()) -> str:
    """The resolved directory to read: inside `root` (resolved already) or one of the `trusted`
    (resolved) dirs given at start-up. Anything else is refused without saying whether it exists."""
    real = os.path.realpath(path)
    if root is None or real in trusted:
        return real
    if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
        return real
    raise FileRefused("the adapter path is not inside the adapter root (--adapter-root)")
