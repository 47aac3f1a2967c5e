"""The safetensors file format, read defensively: open only regular files of bounded size, parse and check
the header (8-byte little-endian length, then JSON) without trusting a number in it, and read byte ranges
with positioned reads under a deadline. Knows nothing of LoRA; errors are `FormatError`s."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from stages.loader.files import FileRefused, open_regular_fd
from stages.loader.header_fast import fast_entries
from stages.loader.safetensors_format import ITEM_SIZES, SUBBYTE, TensorEntry

MAX_HEADER_BYTES = 100 << 20  # the safetensors project's own bound; adapter headers are a few hundred KB


class FormatError(ValueError):
    """The file is not one we read: missing, not regular, too large, or inconsistent (the message says)."""


def open_regular(path: Path, max_bytes: int) -> tuple[int, int]:
    """(fd, size) of a regular file of at most `max_bytes` (`files.open_regular_fd`), refusals as
    FormatError."""
    try:
        return open_regular_fd(path, max_bytes)
    except FileNotFoundError:
        raise FormatError(f"{path.name} does not exist") from None
    except FileRefused as e:
        raise FormatError(str(e)) from None


def read_exact(fd: int, out: memoryview, offset: int, deadline: float) -> None:
    """Fill `out` from byte `offset` of `fd` (positioned reads: no shared file position between threads;
    the GIL is released inside each read). A short file or a passed deadline is a FormatError."""
    done, n = 0, len(out)
    while done < n:
        if time.monotonic() > deadline:
            raise FormatError("reading the tensor data took longer than the read deadline")
        try:
            got = os.preadv(fd, [out[done:]], offset + done)
        except BlockingIOError:
            got = -1  # only a non-regular file answers EAGAIN; open_regular refused those
        except OSError as e:
            raise FormatError(f"read error at byte {offset + done} ({e.strerror})") from None
        if got <= 0:
            raise FormatError(f"the file ends at byte {offset + done}, inside the tensor data (truncated?)")
        done += got


def read_header(fd: int, size: int, deadline: float) -> dict[str, TensorEntry]:
    """The tensors of the file, each checked: a known dtype, a shape of non-negative ints, a byte range
    inside the data section whose length matches dtype and shape; ranges neither overlap nor leave holes.
    A well-formed header takes `header_fast`; any other the reference path below, which words refusals."""
    if sys.byteorder != "little":
        raise FormatError("safetensors data is little-endian; this host is not")
    if size < 8:
        raise FormatError(f"the file has {size} bytes, too short for a header")
    head = bytearray(8)
    read_exact(fd, memoryview(head), 0, deadline)
    n = int.from_bytes(head, "little")
    if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
        raise FormatError(f"header length {n} does not fit the {size}-byte file")
    raw = bytearray(n)
    read_exact(fd, memoryview(raw), 8, deadline)
    entries = fast_entries(raw, 8 + n, size)
    return entries if entries is not None else _checked_entries(raw, n, size)


def _checked_entries(raw: bytearray, n: int, size: int) -> dict[str, TensorEntry]:
    """The reference path: stdlib JSON, then each entry and the coverage checked in turn, each refusal
    worded for the file's author."""
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("the header is not a JSON object")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"bad header ({e})") from None
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FormatError("__metadata__ must map strings to strings")
    data_start, data_len = 8 + n, size - 8 - n
    entries = {name: _entry(name, info, data_start, data_len) for name, info in header.items()}
    _check_coverage(entries.values(), data_start, size)
    return entries


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _entry(name: str, info: object, data_start: int, data_len: int) -> TensorEntry:
    if not isinstance(info, dict) or len(info) != 3:
        raise FormatError(f"tensor {name}: expected exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEM_SIZES:
        raise FormatError(f"tensor {name}: unknown dtype {dtype!r}")
    if type(shape) is not list or any(type(d) is not int or d < 0 for d in shape):
        raise FormatError(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
    if type(offsets) is not list or len(offsets) != 2 or any(type(o) is not int for o in offsets):
        raise FormatError(f"tensor {name}: data_offsets {offsets!r} is not two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise FormatError(f"tensor {name}: data_offsets {offsets} outside the {data_len}-byte data section")
    want = math.prod(shape) * SUBBYTE.get(dtype, ITEM_SIZES[dtype])
    if end - begin != want:
        raise FormatError(f"tensor {name}: {end - begin} bytes for shape {shape} of {dtype} (not {want})")
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_coverage(entries, data_start: int, size: int) -> None:
    """Sorted by offset, each tensor starts where the previous one ended and the last ends the file."""
    cursor, prev = data_start, None
    for e in sorted(entries, key=lambda e: (e.start, e.end)):
        if e.start < cursor:
            raise FormatError(f"tensors {prev} and {e.name} overlap")
        if e.start > cursor:
            raise FormatError(f"bytes {cursor - data_start}..{e.start - data_start} belong to no tensor")
        cursor, prev = e.end, e.name
    if cursor != size:
        raise FormatError(f"bytes {cursor - data_start}..{size - data_start} belong to no tensor")
