"""The fast path of `safetensors_reader.read_header`: a well-formed header decoded and type-checked by
msgspec in C, the few checks left done in bulk. It accepts only what the reference path would accept,
giving the same entries in the same order; for anything else (a file to refuse, or anything unusual:
escapes in strings, repeated keys, huge numbers) it returns None, and the reference path decides, with
its messages."""

from __future__ import annotations

import math
from itertools import chain, repeat
from operator import attrgetter, itemgetter, mul, sub
from typing import Annotated

import msgspec

from stages.loader.safetensors_format import ELEMENT_BYTES, TensorEntry

_DIM = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]  # bounded: below any size the reference path refuses


class _Info(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A tensor's header object: exactly these three keys (msgspec refuses unknown and missing ones;
    `_keys_unique` catches a repeated one)."""

    dtype: str
    shape: tuple[_DIM, ...]
    data_offsets: tuple[int, int]


_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_META = msgspec.json.Decoder(dict[str, str] | None)
_INFOS = msgspec.json.Decoder(list[_Info])
_DTYPE, _SHAPE, _OFFSETS = attrgetter("dtype"), attrgetter("shape"), attrgetter("data_offsets")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_NO_META = object()


def fast_entries(raw: bytes | bytearray, data_start: int, size: int) -> dict[str, TensorEntry] | None:
    """The header's entries as `read_header` gives them, or None where the reference path must decide.
    `raw` is the JSON header, `data_start` the file offset after it, `size` the file's size."""
    if raw[:1] != b"{" or b"\\" in raw:  # no escapes: each string's text is its value (`_keys_unique`)
        return None
    try:
        raw.decode("utf-8")  # as the reference path does (msgspec validates too, perhaps differently)
        top = _TOP.decode(raw)
        meta = _META.decode(top.pop("__metadata__")) if "__metadata__" in top else _NO_META
        infos = _INFOS.decode(b"[" + b",".join(top.values()) + b"]")
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    if not infos or not _keys_unique(raw, top, meta):
        return None
    return _entries(list(top), infos, data_start, size)


def _keys_unique(raw: bytes | bytearray, top: dict, meta: object) -> bool:
    """Whether no object repeats a key (the reference path refuses that; msgspec keeps the last value).
    Outside strings a ':' only follows a key, so the text's ':' count is its key count plus the ':' in
    its strings, which without escapes are the decoded strings (names, metadata; dtypes are checked to
    hold none). The distinct keys: the tensors' names and __metadata__, three per tensor, the metadata's.
    A repeated key is one more ':' than these."""
    keys = 4 * len(top)
    in_strings = "".join(top).count(":")
    if meta is not _NO_META:
        meta = meta or {}
        keys += 1 + len(meta)
        in_strings += "".join(meta).count(":") + "".join(meta.values()).count(":")
    return raw.count(b":") == keys + in_strings


def _entries(names: list[str], infos: list[_Info], data_start: int, size: int) -> dict | None:
    """TensorEntries, if every tensor's byte range lies in the data section and matches its dtype and
    shape, and the ranges tile the section (else None: the reference path words the refusal)."""
    dtypes = list(map(_DTYPE, infos))
    if not set(dtypes) <= ELEMENT_BYTES.keys():
        return None
    shapes = list(map(_SHAPE, infos))
    offsets = list(map(_OFFSETS, infos))
    begins, ends = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
    lengths = list(map(sub, ends, begins))
    if min(begins) < 0 or min(lengths) < 0 or max(ends) > size - data_start:
        return None
    if lengths != list(map(mul, map(math.prod, shapes), map(ELEMENT_BYTES.__getitem__, dtypes))):
        return None
    starts, stops = list(map(data_start.__add__, begins)), list(map(data_start.__add__, ends))
    # sorted by (start, end), each range must start where the previous one ends: [s0, e0, s1, e1, ...]
    bounds = list(chain.from_iterable(sorted(zip(starts, stops, strict=True))))
    if bounds[0] != data_start or bounds[-1] != size or bounds[1:-1:2] != bounds[2::2]:
        return None
    made = map(tuple.__new__, repeat(TensorEntry), zip(names, dtypes, shapes, starts, stops, strict=True))
    return dict(zip(names, made, strict=True))  # TensorEntry(...) without its Python-level __new__
