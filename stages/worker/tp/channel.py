"""Rank 0's hand-over to the other ranks of a tensor-parallel worker: one ZeroMQ PUSH socket per other rank
(ipc, bound by rank 0, through `runtime.base.sockets`), one msgspec frame a message
(`proto/tensor_parallel.py`). A send never waits on a rank that is behind: it queues (up to LAG_HWM
messages, which only a stuck rank reaches, as every step's collectives keep the ranks together); the
ranks read in rank 0's order. A receiver waits in a poll with a timeout, so that closing it (from any
thread) wakes it, and a rank whose parent process is gone stops waiting."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import zmq

from proto.codec import Codec
from proto.tensor_parallel import RankZeroToRanks
from runtime.base.sockets import PullSocket, PushSocket

ONE_FRAME = 1 << 62  # every buffer inline: a message is one frame
LAG_HWM = 4096  # messages a rank may be behind before rank 0's send waits (for it, or for its death)
POLL_S = 0.05  # how often a waiting sender checks the ranks, and a waiting receiver its stop flag
# linger 0: a closed channel never waits to deliver (a rank that should still read is being killed)
_OPTS = {"hwm": LAG_HWM, "linger_ms": 0}


class ChannelClosed(RuntimeError):
    pass


def rank_codec() -> Codec:
    return Codec(RankZeroToRanks, inline_max=ONE_FRAME)


def rank_address(directory: str | Path, rank: int) -> str:
    return f"ipc://{Path(directory) / f'rank{rank}.ipc'}"


class StepSender:
    """Rank 0's end: one PUSH per other rank, bound at `rank_address(directory, k)` for k in 1..size-1."""

    def __init__(self, directory: str | Path, size: int):
        self.ctx = zmq.Context()
        self.codec = rank_codec()
        self.socks: list[PushSocket] = []
        try:
            for rank in range(1, size):
                addr = rank_address(directory, rank)
                self.socks.append(PushSocket(addr, RankZeroToRanks, bind=True, ctx=self.ctx, **_OPTS))
        except BaseException:
            self.close()
            raise

    def send(self, msg, check: Callable[[], None]) -> None:
        """Queue `msg` for every other rank and return. Only a rank LAG_HWM messages behind (or not yet
        connected) makes it wait, calling `check()` every POLL_S (which raises if a rank has exited)."""
        (frame,) = self.codec.encode(msg)
        for push in self.socks:
            while True:
                try:
                    push.sock.send(frame, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    check()
                    push.sock.poll(int(POLL_S * 1000), zmq.POLLOUT)

    def close(self) -> None:
        """Unsent messages are dropped (linger 0): the ranks have stopped, or are being killed."""
        for push in self.socks:
            push.close()
        if not self.ctx.closed:
            self.ctx.term()


class StepReceiver:
    """A rank's end: a PULL connected to rank 0's socket for this rank. One thread receives; `close` may
    come from any thread."""

    def __init__(self, address: str, parent_pid: int | None = None):
        """`parent_pid`: a `recv` that finds this process's parent changed (rank 0's process died) raises
        ChannelClosed instead of waiting."""
        self.ctx = zmq.Context()
        self.codec = rank_codec()
        self.parent_pid = parent_pid
        self.pull = PullSocket(address, RankZeroToRanks, bind=False, ctx=self.ctx, **_OPTS)
        self._poller = zmq.Poller()
        self._poller.register(self.pull.sock, zmq.POLLIN)
        self._stop = threading.Event()
        self._using = threading.Lock()  # held by a recv: the socket is closed by whoever holds it

    def recv(self):
        """The next message; ChannelClosed once `close()` was called (a waiting recv wakes within
        POLL_S) or when rank 0's process is gone."""
        with self._using:
            sock = self.pull.sock
            while not self._stop.is_set():
                try:  # a message already queued (rank 0 runs ahead) costs no poll
                    return self.codec.decode([sock.recv(zmq.NOBLOCK, copy=False)])
                except zmq.Again:
                    pass
                if not self._poller.poll(int(POLL_S * 1000)):
                    if self.parent_pid is not None and os.getppid() != self.parent_pid:
                        raise ChannelClosed(f"rank 0 (pid {self.parent_pid}) is gone")
            self._release()
            raise ChannelClosed("the channel from rank 0 was closed")

    def close(self) -> None:
        """Close the socket now, or, while a recv waits on another thread, make that recv close it."""
        self._stop.set()
        if self._using.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._using.release()

    def _release(self) -> None:
        if not self.pull.sock.closed:
            self.pull.close()
            self.ctx.term()
