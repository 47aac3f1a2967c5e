"""Hostile inputs for integration tests: raw frames (the issue's 4-byte frame, a prompt holding a lone
surrogate, seeded mutations of valid messages, random bytes), a raw DEALER and plain TCP to throw them,
every internal edge of a running server found from its stage configs, and the launcher's descendants."""

from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from proto.base import EDGES, PROTOCOL_VERSION, UNIONS, TokenIds
from proto.client import ClientRequest, GenerateRequest, Hello, LoadAdapter
from proto.codec import Codec, ProtocolError
from proto.sampling import SamplingParams
from tests.integration.serving import Server

ISSUE_FRAME = b"\x91\xa2\xff\xfe"  # a 1-array holding a 2-byte str that is not UTF-8


def _str(s: bytes) -> bytes:
    return bytes([0xA0 | len(s)]) + s


SURROGATE_PROMPT = b"\x93" + _str(b"GenerateRequest") + _str(b"surrogate") + _str(b"ab\xed\xa0\x80")

# which stage binds each internal edge's receiving socket (its PULL, or the launcher's ROUTER)
EDGE_RECEIVERS = {
    "tokenizer_to_scheduler": "scheduler",
    "scheduler_to_tokenizer": "tokenizer",
    "scheduler_to_worker": "worker",
    "worker_to_scheduler": "scheduler",
    "worker_to_tokenizer": "tokenizer",
    "scheduler_to_loader": "loader",
    "loader_to_scheduler": "scheduler",
}


def mutate(rng: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(data) + 1)
        match rng.randrange(3):
            case 0 if data:
                data[min(pos, len(data) - 1)] = rng.randrange(256)
            case 1:
                data[pos:pos] = rng.randbytes(rng.randint(1, 8))
            case _:
                del data[pos : pos + rng.randint(1, 8)]
    return bytes(data)


def client_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    """`n` messages for the client endpoint: mutations of valid requests and random bytes."""
    codec = Codec(ClientRequest)
    valid = [
        Hello(request_id="h", protocol_version=PROTOCOL_VERSION),
        GenerateRequest(request_id="g", prompt="The river", sampling=SamplingParams(max_tokens=2)),
        GenerateRequest(
            request_id="i", prompt_ids=TokenIds.of(range(300)), sampling=SamplingParams(max_tokens=2)
        ),
        LoadAdapter(request_id="l", name="x", path="/nonexistent"),
    ]
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append([rng.randbytes(rng.randint(0, 256))])
            continue
        frames = [bytes(f) for f in codec.encode(valid[i % len(valid)])]
        out.append([mutate(rng, frames[0]), *frames[1:]])
    return out


def refused_frames(edge: str, rng: random.Random, n: int) -> list[list[bytes]]:
    """Frames the edge's codec refuses (so a fuzzed internal edge never carries a forged message)."""
    codec = Codec(UNIONS[edge])
    from tests.proto.examples import EXAMPLES

    valid = [[bytes(f) for f in codec.encode(m)] for m in EXAMPLES if type(m) in EDGES[edge]]
    out = [[ISSUE_FRAME]]
    while len(out) < n:
        frames = rng.choice(valid)
        candidate = [mutate(rng, frames[0]), *frames[1:]] if rng.random() < 0.7 else [rng.randbytes(64)]
        try:
            codec.decode(candidate)
        except ProtocolError:
            out.append(candidate)
    return out


def raw_dealer(endpoint: str, ctx: zmq.Context) -> zmq.Socket:
    """A plain DEALER (not the SDK's socket helper), so any frames at all can be sent."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDHWM, 100000)
    sock.connect(endpoint)
    return sock


def tcp_garbage(endpoint: str, rng: random.Random, nbytes: int = 4096) -> None:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            s.sendall(rng.randbytes(nbytes))
            s.settimeout(1.0)
            s.recv(1024)  # the peer may answer its greeting or close
        except OSError:
            pass


def stage_config(server: Server, stage: str) -> dict[str, Any]:
    """The running stage's config (its argv names the JSON file the launcher wrote)."""
    pid = server.stage_pid(stage)
    assert pid is not None, f"no {stage} process"
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return json.loads(Path(argv[argv.index(f"stages.{stage}".encode()) + 1].decode()).read_bytes())


def endpoints_of(server: Server) -> dict[str, str]:
    return msgspec.to_builtins(stage_config(server, "tokenizer")["endpoints"])


def recv_all(sock: zmq.Socket, timeout_s: float) -> list[Any]:
    """Decoded replies that arrive until `timeout_s` passes without one."""
    from proto.client import ClientReply

    codec, out = Codec(ClientReply), []
    while sock.poll(int(timeout_s * 1000)):
        frames = sock.recv_multipart()
        try:
            out.append(codec.decode(frames))
        except ProtocolError:
            out.append(None)
    return out


def live_descendants(pids: list[int]) -> list[str]:
    """Of `pids`, those still running (zombies are dead), as "pid cmdline"."""
    import psutil

    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(p.cmdline())}")
        except psutil.NoSuchProcess:
            pass
    return alive


def descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def wait_until(cond, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)
    return value
