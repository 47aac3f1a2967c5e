"""Every byte sequence decodes to a message of the edge's union or raises ProtocolError, nothing else:
hostile frames (invalid UTF-8, a lone surrogate), seeded mutations of every example message
and random bytes, on every edge; limits refuse a message before its body is looked at."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from proto import EDGES, Codec, ProtocolError
from proto.base import UNIONS
from proto.client import ClientRequest, Hello
from tests.proto.examples import EXAMPLES

SEED = 12
ROUNDS = 400  # mutations per example message


def _decode_or_protocol_error(codec: Codec, frames: list) -> None:
    try:
        msg = codec.decode(frames)
    except ProtocolError:
        return
    except BaseException as exc:  # the failure this test exists for
        raise AssertionError(f"{type(exc).__name__} escaped the codec for {frames!r:.200}") from exc
    assert type(msg) in EDGES[_edge_of_codec(codec)], msg


def _edge_of_codec(codec: Codec) -> str:
    return next(name for name, union in UNIONS.items() if union is codec.msg_type)


def _mutate(rng: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:  # flip a byte
            data[min(pos, len(data) - 1)] = rng.randrange(256)
        elif op == 1:  # insert bytes
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2 and data:  # delete a run
            del data[pos : pos + rng.randint(1, 8)]
        else:  # truncate
            del data[pos:]
    return bytes(data)


def test_issue_frames_are_protocol_errors():
    codec = Codec(ClientRequest)
    surrogate = b"\x93\xafGenerateRequest\xa1r\xa3\xed\xa0\x80"  # the prompt "\ud800" in CESU bytes
    for frames in ([b"\x91\xa2\xff\xfe"], [surrogate], [b"\xdd\xff\xff\xff\xff"], [b"\x91" * 100_000]):
        with pytest.raises(ProtocolError):
            codec.decode(frames)


@pytest.mark.parametrize("edge", sorted(EDGES))
def test_mutated_and_random_frames_never_escape(edge: str):
    rng = random.Random(f"{SEED}:{edge}")
    codec = Codec(UNIONS[edge])
    examples = [m for m in EXAMPLES if type(m) in EDGES[edge]]
    deadline = time.monotonic() + 20
    for msg in examples:
        frames = [bytes(f) for f in codec.encode(msg)]
        for _ in range(ROUNDS):
            mutated = [_mutate(rng, frames[0]), *frames[1:]]
            if rng.random() < 0.2 and len(frames) > 1:
                mutated.pop()  # a referenced buffer goes missing
            _decode_or_protocol_error(codec, mutated)
        assert time.monotonic() < deadline
    for _ in range(ROUNDS):
        _decode_or_protocol_error(codec, [rng.randbytes(rng.randint(0, 64))])
        _decode_or_protocol_error(codec, [rng.randbytes(8) for _ in range(rng.randint(1, 4))])
    good = codec.encode(examples[0])
    assert codec.decode(good) == examples[0]  # the codec still works after all that


def test_limits_apply_before_decoding():
    codec = Codec(ClientRequest, max_frames=2, max_bytes=1024)
    hello = Hello(request_id="h", protocol_version=1)
    body = codec.encode(hello)[0]
    assert codec.decode([body]) == hello
    with pytest.raises(ProtocolError, match="3 frames"):
        codec.decode([body, b"a", b"b"])
    with pytest.raises(ProtocolError, match="bytes"):
        codec.decode([body + b"\0" * 2048])
    big = msgspec.msgpack.encode(["Hello", "x" * 4096, 1])  # valid, but over the limit: never decoded
    with pytest.raises(ProtocolError, match="at most 1024"):
        codec.decode([big])
