"""The wire format: every message round-trips, buffers ride as extra frames, bad input is a ProtocolError."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from proto import EDGES, PROTOCOL_VERSION, Codec, ProtocolError, TokenIds
from proto.base import UNIONS, Message, edge
from proto.client import ClientRequest, GenerateRequest, Hello
from proto.control import ProtocolMismatch, Ready, check_ready
from proto.pipeline import TokenizedRequest, TokenizerToScheduler
from tests.proto.examples import EXAMPLES, LONG_IDS

ROOT = Path(__file__).resolve().parents[2]


def _edge_of(cls: type) -> str:
    return next(name for name, members in EDGES.items() if cls in members)


def test_every_message_has_an_example_and_one_edge():
    wire = {cls for members in EDGES.values() for cls in members}
    assert {type(m) for m in EXAMPLES} == wire
    for cls in wire:
        assert sum(cls in members for members in EDGES.values()) == 1, cls


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message):
    codec = Codec(UNIONS[_edge_of(type(msg))])
    frames = codec.encode(msg)
    assert codec.decode([bytes(f) for f in frames]) == msg
    assert codec.decode(frames) == msg  # views work as well as copies


def test_large_buffers_travel_as_extra_frames():
    codec = Codec(TokenizerToScheduler)
    frames = codec.encode(TokenizedRequest(request_id="r", prompt_ids=LONG_IDS))
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == 4 * 5000
    assert len(frames[0]) < 64  # the body holds a 4-byte reference, not the ids
    out = codec.decode(frames)
    assert out.prompt_ids.tolist() == list(range(5000))
    assert out.prompt_ids.data.obj is frames[1].obj  # decoded as a view of the frame, not a copy
    small = codec.encode(TokenizedRequest(request_id="r", prompt_ids=TokenIds.of([1, 2])))
    assert len(small) == 1


def test_malformed_frames_raise_protocol_error_and_next_decodes():
    codec = Codec(ClientRequest)
    good = codec.encode(Hello(request_id="x", protocol_version=PROTOCOL_VERSION))
    bad_inputs = [
        [b"\xc1garbage"],  # not msgpack
        [msgspec.msgpack.encode(["NoSuchMessage", "x"])],  # unknown tag
        [msgspec.msgpack.encode(["Hello", "x", "not-an-int"])],  # wrong field type
        [msgspec.msgpack.encode(["GenerateRequest", "r", None, "not-bytes"])],  # not a buffer
        [msgspec.msgpack.encode(["GenerateRequest", "r", None, b"odd"])],  # not whole int32s
        [*good, b"stray frame"],  # an extra frame nobody references
        [msgspec.msgpack.encode(["GenerateRequest", "r", None, msgspec.msgpack.Ext(1, b"\x05\0\0\0")])],
        [msgspec.msgpack.encode(["GenerateRequest", "r", None, msgspec.msgpack.Ext(1, b"\0\0\0\0")]), b"abc"],
        [],
    ]
    for frames in bad_inputs:
        with pytest.raises(ProtocolError):
            codec.decode(frames)
        assert codec.decode(good) == Hello(request_id="x", protocol_version=PROTOCOL_VERSION)


def test_protocol_error_keeps_identity_and_body():
    with pytest.raises(ProtocolError) as info:
        Codec(ClientRequest).decode([b"\x92\xa5Hello\xa1x"], identity=b"peer")
    assert info.value.identity == b"peer" and info.value.body.startswith(b"\x92")


def test_protocol_version_mismatch_is_refused():
    check_ready(Ready(stage="worker", pid=1, protocol_version=PROTOCOL_VERSION))
    with pytest.raises(ProtocolMismatch, match="worker"):
        check_ready(Ready(stage="worker", pid=1, protocol_version=PROTOCOL_VERSION + 1))


def test_naming_rule_is_enforced():
    class Ready(Message):  # same tag as proto.control.Ready
        x: int

    with pytest.raises(TypeError, match="tag 'Ready'"):
        edge("test_dup_tag", Ready)

    class Unfrozen(msgspec.Struct, tag=True):
        x: int

    with pytest.raises(TypeError):
        edge("test_not_message", Unfrozen)
    with pytest.raises(TypeError, match="twice"):
        edge("client_to_tokenizer", Hello)


def test_unknown_objects_are_not_encoded():
    codec = Codec(ClientRequest)
    with pytest.raises(TypeError):
        codec.encode(GenerateRequest(request_id="r", prompt=object()))  # type: ignore[arg-type]


def test_token_ids_validate_their_payload():
    assert TokenIds.of([3, 2**31 - 1]).tolist() == [3, 2**31 - 1]
    with pytest.raises(ValueError):
        TokenIds(b"abc")
    with pytest.raises(OverflowError):
        TokenIds.of([2**40])


def test_proto_imports_no_torch_and_no_pickle():
    code = "import sys, proto; assert 'torch' not in sys.modules, 'torch'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
    for path in (ROOT / "proto").glob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+\w*pickle", path.read_text(), re.M), path
