"""The socket helper over real ipc:// sockets: typed round trips, extra frames, ProtocolError on bad
input, PeerGone, bounded queues (a full peer blocks the sender) and ipc files removed on close."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from proto.base import TokenIds
from proto.client import Ack, ClientReply, ClientRequest, Hello
from proto.pipeline import TokenBatch, TokenDelta, TokenizedRequest, TokenizerToScheduler, WorkerToTokenizer
from runtime.base.actor import Mailbox
from runtime.base.sockets import (
    DealerSocket,
    PeerBusy,
    PeerGone,
    ProtocolError,
    PullSocket,
    PushSocket,
    RouterSocket,
)

pytestmark = pytest.mark.timeout(30)


def _batch(step: int, payload: int = 1) -> TokenBatch:
    return TokenBatch(step=step, items=[TokenDelta(request_id="r", token_ids=[7] * payload)])


def test_push_pull_round_trip_with_extra_frames(tmp_path):
    async def main() -> None:
        addr = f"ipc://{tmp_path}/a.sock"
        with PullSocket(addr, TokenizerToScheduler) as pull, PushSocket(addr, TokenizerToScheduler) as push:
            msg = TokenizedRequest(request_id="r", prompt_ids=TokenIds.of(range(100_000)))
            await push.send(msg)
            got = await pull.recv()
            assert got == msg and len(got.prompt_ids) == 100_000
        assert not (tmp_path / "a.sock").exists()

    asyncio.run(main())


def test_malformed_frame_raises_and_next_message_decodes(tmp_path):
    async def main() -> None:
        addr = f"ipc://{tmp_path}/b.sock"
        with PullSocket(addr, WorkerToTokenizer) as pull:
            raw = zmq.asyncio.Context.instance().socket(zmq.PUSH)
            raw.connect(addr)
            await raw.send_multipart([b"\x00\xffnot a message"])
            await raw.send_multipart([_encode(_batch(1))])
            with pytest.raises(ProtocolError):
                await pull.recv()
            assert await pull.recv() == _batch(1)
            raw.close(0)

    asyncio.run(main())


def _encode(msg: TokenBatch) -> bytes:
    from proto.codec import Codec

    (body,) = Codec(WorkerToTokenizer).encode(msg)
    return body


def test_router_dealer_and_peer_gone(tmp_path):
    async def main() -> None:
        addr = f"ipc://{tmp_path}/c.sock"
        with (
            RouterSocket(addr, ClientRequest, ClientReply) as router,
            DealerSocket(addr, ClientReply, ClientRequest) as dealer,
        ):
            await dealer.send(Hello(request_id="h", protocol_version=1))
            identity, msg = await router.recv()
            assert msg == Hello(request_id="h", protocol_version=1)
            await router.send(identity, Ack(request_id="h"))
            assert await dealer.recv() == Ack(request_id="h")
            with pytest.raises(PeerGone):
                await router.send(b"nobody", Ack(request_id="x"))

    asyncio.run(main())


def test_high_water_mark_must_be_finite(tmp_path):
    with pytest.raises(ValueError):
        PushSocket(f"ipc://{tmp_path}/d.sock", WorkerToTokenizer, hwm=0)


def test_full_inbox_backpressures_the_sender(tmp_path):
    """A receiver whose bounded inbox is full stops reading; the zmq queues fill up to their
    high-water marks and then the sender cannot send: nothing grows without bound."""

    async def main() -> None:
        addr = f"ipc://{tmp_path}/f.sock"
        inbox: Mailbox[TokenBatch] = Mailbox("inbox", maxsize=2)
        with (
            PullSocket(addr, WorkerToTokenizer, hwm=2) as pull,
            PushSocket(addr, WorkerToTokenizer, hwm=2) as push,
        ):

            async def receive() -> None:
                while True:
                    await inbox.put(await pull.recv())

            receiver = asyncio.create_task(receive())
            big = _batch(0, payload=50_000)  # ~50 kB bodies fill the kernel socket buffers quickly
            sent = 0
            while True:
                # a send that stays pending for 0.2 s is blocked: inbox, receiver, both zmq pipes
                # and the kernel buffer are all full
                blocked = asyncio.create_task(push.send(big))
                await asyncio.wait({blocked}, timeout=0.2)
                if not blocked.done():
                    break
                sent += 1
                assert sent < 1000, "the sender was never blocked"
            assert inbox.qsize() == inbox.maxsize == 2
            received = 0
            while not blocked.done():  # consuming unblocks the whole chain
                if not inbox.empty():
                    await inbox.get()
                    received += 1
                await asyncio.wait({blocked}, timeout=0.001)
            assert received <= sent + 1
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)

    asyncio.run(main())


def test_router_send_to_a_peer_that_stopped_reading_raises_peer_busy(tmp_path):
    async def main() -> None:
        addr = f"ipc://{tmp_path}/g.sock"
        with (
            RouterSocket(addr, WorkerToTokenizer, WorkerToTokenizer, hwm=2) as router,
            DealerSocket(addr, WorkerToTokenizer, WorkerToTokenizer, hwm=2) as dealer,
        ):
            await dealer.send(_batch(0))
            identity, _ = await router.recv()
            big = _batch(0, payload=50_000)
            with pytest.raises(PeerBusy):
                for _ in range(1000):  # the dealer never reads: its queues fill, then the send refuses
                    await router.send(identity, big)

    asyncio.run(main())
