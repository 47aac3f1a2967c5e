"""The msgspec fast path of the safetensors header reader never decides differently from the reference
path: on any header it either declines (None: the reference path then reads it, and words any refusal)
or gives exactly the reference path's entries, in order. It takes every ordinary well-formed header,
and declines repeated keys (msgspec keeps the last value), escapes, extra or missing fields, odd numbers
and every inconsistency of offsets, on hand-made cases and on random mutations of a valid header."""

from __future__ import annotations

import json
import random

import pytest

from stages.loader.header_fast import fast_entries
from stages.loader.safetensors_reader import FormatError, _checked_entries

pytestmark = pytest.mark.timeout(120)


def header(names=("a.lora_A.weight", "a.lora_B.weight", "b.lora_A.weight"), **extra) -> dict:
    """Three tensors filling a 50-byte data section, metadata, and `extra` entries."""
    infos = (
        {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        {"dtype": "BF16", "shape": [4, 2], "data_offsets": [24, 40]},
        {"dtype": "F16", "shape": [1, 5], "data_offsets": [40, 50]},
    )
    return {"__metadata__": {"format": "pt"}, **dict(zip(names, infos, strict=True)), **extra}


def both(raw: bytes, data_len: int = 50):
    """(fast path's answer, reference path's entries or FormatError), after checking they agree."""
    size = 8 + len(raw) + data_len
    fast = fast_entries(bytearray(raw), 8 + len(raw), size)
    try:
        ref = _checked_entries(bytearray(raw), len(raw), size)
    except FormatError as e:
        ref = e
    if fast is not None:
        assert not isinstance(ref, FormatError), (raw, ref)
        assert fast == ref and list(fast) == list(ref), raw
    return fast, ref


ONE_BYTE = {"dtype": "U8", "shape": [1], "data_offsets": [50, 51]}  # one more byte after the three


def enc(h: dict, **kw) -> bytes:
    return json.dumps(h, **kw).encode()


ACCEPTED = {
    "plain": enc(header()),
    "compact": enc(header(), separators=(",", ":")),
    "indented": enc(header(), indent=2),
    "padded": enc(header()) + b"        ",
    "no metadata": enc({k: v for k, v in header().items() if k != "__metadata__"}),
    "null metadata": enc(header(__metadata__=None)),
    "empty metadata": enc(header(__metadata__={})),
    "colons": enc(header(("a:A", "a:B", ":"), __metadata__={"k:1": "v:2:3", "x": ":"})),
    "empty tensor": enc(header(z={"dtype": "F32", "shape": [0, 7], "data_offsets": [24, 24]})),
    "scalar": enc(header(s={"dtype": "F64", "shape": [], "data_offsets": [50, 58]})),
    "packed dtype": enc(header(f={"dtype": "F4", "shape": [2, 3], "data_offsets": [50, 53]})),
    "unicode name": enc(header(**{"é": ONE_BYTE}), ensure_ascii=False),
}  # fmt: skip
EXTRA = {
    "scalar": 8,
    "packed dtype": 3,
    "unicode name": 1,
    "escape": 1,
    "escaped quote": 1,
    "wrong length": 1,
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_ordinary_headers_take_the_fast_path(case):
    fast, ref = both(ACCEPTED[case], 50 + EXTRA.get(case, 0))
    assert fast is not None, ref


def _dup_top() -> bytes:
    entry = json.dumps(header()["b.lora_A.weight"])
    return enc(header()).replace(b"}}", f'}}, "b.lora_A.weight": {entry}}}'.encode(), 1)


DECLINED = {
    "repeated tensor": _dup_top(),
    "repeated field": enc(header()).replace(b'"dtype": "F16",', b'"dtype": "F16", "dtype": "F16",'),
    "repeated metadata key": enc(header()).replace(b'"format": "pt"', b'"format": "pt", "format": "pt"'),
    "repeated metadata": enc(header()).replace(b"{", b'{"__metadata__": {}, ', 1),
    "escape": enc(header(**{"\u00e9": ONE_BYTE})),
    "escaped quote": enc(header(**{'q"': ONE_BYTE})),
    "extra field": enc(header(x={"dtype": "U8", "shape": [1], "data_offsets": [50, 51], "more": 1})),
    "missing field": enc(header(x={"dtype": "U8", "shape": [1]})),
    "float dim": enc(header(x={"dtype": "U8", "shape": [1.0], "data_offsets": [50, 51]})),
    "bool dim": enc(header(x={"dtype": "U8", "shape": [True], "data_offsets": [50, 51]})),
    "negative dim": enc(header(x={"dtype": "U8", "shape": [-1], "data_offsets": [50, 51]})),
    "huge dim": enc(header(x={"dtype": "U8", "shape": [0, 10**30], "data_offsets": [50, 50]})),
    "enormous dim": enc(header(x={"dtype": "U8", "shape": [0, 7], "data_offsets": [50, 50]}))
    .replace(b"[0, 7]", b"[0, 1" + b"0" * 5000 + b"]"),
    "nan dim": enc(header(x={"dtype": "U8", "shape": [float("nan")], "data_offsets": [50, 51]})),
    "three offsets": enc(header(x={"dtype": "U8", "shape": [1], "data_offsets": [50, 51, 52]})),
    "negative offset": enc(header(x={"dtype": "U8", "shape": [0], "data_offsets": [-1, -1]})),
    "reversed offsets": enc(header(x={"dtype": "U8", "shape": [1], "data_offsets": [51, 50]})),
    "past the data": enc(header(x={"dtype": "U8", "shape": [1], "data_offsets": [50, 51]})),
    "wrong length": enc(header(x={"dtype": "F32", "shape": [1], "data_offsets": [50, 51]})),
    "unknown dtype": enc(header(x={"dtype": "F:32", "shape": [0], "data_offsets": [50, 50]})),
    "overlap": enc(header(x={"dtype": "U8", "shape": [2], "data_offsets": [48, 50]})),
    "empty inside another": enc(header(x={"dtype": "U8", "shape": [0], "data_offsets": [30, 30]})),
    "metadata not strings": enc(header(__metadata__={"n": 1})),
    "metadata a list": enc(header(__metadata__=["pt"])),
    "leading space": b" " + enc(header()),
    "an array": enc([header()]),
    "trailing data": enc(header()) + b"x",
    "bad utf-8": enc(header()).replace(b"b.lora", b"\xff.lora"),
    "nothing": b"{}",
    "metadata only": enc({"__metadata__": {"format": "pt"}}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DECLINED))
def test_anything_else_is_left_to_the_reference_path(case):
    fast, _ = both(DECLINED[case], 50 + EXTRA.get(case, 0))
    assert fast is None


def test_a_hole_or_a_short_section_is_left_to_the_reference_path():
    for data_len in (49, 51):
        fast, ref = both(ACCEPTED["plain"], data_len)
        assert fast is None and isinstance(ref, FormatError)


def test_random_mutations_never_disagree():
    rng = random.Random(0)
    seeds = [ACCEPTED[c] for c in ("plain", "compact", "colons", "empty tensor")]
    alphabet = b'{}[]":,0123456789-. \\eEa_'
    taken = 0
    for _ in range(6000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(raw))
            op = rng.random()
            if op < 0.4:
                raw[i] = rng.choice(alphabet)
            elif op < 0.6:
                del raw[i : i + rng.randint(1, 4)]
            elif op < 0.8:
                raw[i:i] = bytes([rng.choice(alphabet)])
            else:  # repeat a stretch: often a repeated key
                j = rng.randrange(i, min(len(raw), i + 60) + 1)
                raw[j:j] = raw[i:j]
        fast, _ = both(bytes(raw), rng.choice((49, 50, 51)))
        taken += fast is not None
    assert taken > 0  # some mutations (a digit in a name) stay valid and must agree
