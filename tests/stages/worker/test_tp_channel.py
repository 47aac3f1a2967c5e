"""Rank 0's hand-over to the other tensor-parallel ranks (`stages/worker/tp/channel.py`, real ZeroMQ ipc
sockets, both ends in this process): messages arrive whole and in the order sent, a send never waits on a
rank that reads nothing, a large step travels as one frame, a rank that never connects fails the send
through the caller's check, and a receiver waiting on another thread wakes when closed or when its
parent is not rank 0's process."""

from __future__ import annotations

import os
import threading
import time

import pytest

from proto.base import TokenIds
from proto.plan import BatchPlan, CachedRequestData, NewRequestData
from proto.sampling import SamplingParams
from proto.tensor_parallel import AddAdapter, BeginRun, EndRun, LaunchStep, StopRanks, SyncCopies
from stages.worker.tp.channel import LAG_HWM, POLL_S, ChannelClosed, StepReceiver, StepSender, rank_address

pytestmark = pytest.mark.timeout(60)
WAKE_S = POLL_S + 2.0  # a waiting receiver's bound to notice a close or a dead parent (slack: a busy CI)


class RankGone(RuntimeError):
    pass


def _never_waits() -> None:
    raise AssertionError("the send waited on a rank")


def _step(i: int, batch: int = 4) -> LaunchStep:
    cached = [CachedRequestData(request_id=f"r{i}.{k}", num_scheduled_tokens=1) for k in range(batch)]
    return LaunchStep(plan=BatchPlan(step=i, cached_requests=cached), finished=max(0, i - 1))


@pytest.fixture
def channel(tmp_path):
    sender = StepSender(tmp_path, 2)
    receiver = StepReceiver(rank_address(tmp_path, 1))
    yield sender, receiver
    receiver.close()
    sender.close()


def _connected(sender: StepSender, receiver: StepReceiver) -> None:
    """One message there and back through the sockets: the connection is up."""
    sender.send(EndRun(), lambda: None)
    assert receiver.recv() == EndRun()


def test_messages_arrive_in_order_and_sending_never_waits_on_a_rank(channel):
    sender, receiver = channel
    _connected(sender, receiver)
    others = [SyncCopies(), AddAdapter(name="a", path="/a"), BeginRun(max_model_len=64, seed=3), EndRun()]
    # half the queue: within the sender's own share even before any has moved on to the receiver
    sent = [_step(i) if i % 5 else others[(i // 5) % len(others)] for i in range(LAG_HWM // 2)]
    sent.append(StopRanks())
    start = time.perf_counter()
    for msg in sent:  # the receiver reads none of them meanwhile
        sender.send(msg, _never_waits)
    per_send_us = (time.perf_counter() - start) / len(sent) * 1e6
    assert [receiver.recv() for _ in sent] == sent
    assert per_send_us < 1000, f"{per_send_us:.0f} us a send"


def test_a_large_step_travels_whole(channel):
    sender, receiver = channel
    _connected(sender, receiver)
    greedy = SamplingParams(max_tokens=8)
    new = [
        NewRequestData(
            request_id=f"p{k}",
            prompt_ids=TokenIds.of(range(k, k + 32_768)),
            sampling=greedy,
            page_ids=list(range(k * 2048, (k + 1) * 2048)),
            num_scheduled_tokens=32_768,
            slot=k % 3,
        )
        for k in range(64)
    ]  # 8 MiB of prompts and 512 KiB of page ids
    big = LaunchStep(plan=BatchPlan(step=7, new_requests=new), finished=6)
    (frame,) = sender.codec.encode(big)
    assert len(frame) > 8 << 20
    sender.send(big, _never_waits)
    got = receiver.recv()
    assert got == big
    assert bytes(got.plan.new_requests[63].prompt_ids) == bytes(new[63].prompt_ids)


def test_a_rank_that_never_connects_fails_the_send_through_the_check(tmp_path):
    sender = StepSender(tmp_path, 3)
    receiver = StepReceiver(rank_address(tmp_path, 1))  # rank 2 never comes
    checks = []

    def check() -> None:
        checks.append(1)
        if len(checks) == 3:
            raise RankGone("rank 2 exited")

    try:
        with pytest.raises(RankGone):
            sender.send(SyncCopies(), check)
        assert receiver.recv() == SyncCopies()  # rank 1 got it before the send reached rank 2
    finally:
        receiver.close()
        sender.close()


def _recv_on_thread(receiver: StepReceiver) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["msg"] = receiver.recv()
        except ChannelClosed as e:
            out["closed"] = str(e)
            out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_close_wakes_a_receiver_waiting_on_another_thread(channel):
    sender, receiver = channel
    _connected(sender, receiver)
    t, out = _recv_on_thread(receiver)
    closed = time.monotonic()
    receiver.close()
    t.join(WAKE_S)
    assert not t.is_alive(), "a receiver waiting for rank 0 did not wake on close"
    assert "was closed" in out["closed"] and out["at"] - closed < WAKE_S
    assert receiver.pull.sock.closed, "the receiving thread left its socket open"
    with pytest.raises(ChannelClosed):
        receiver.recv()


def test_close_on_the_receiving_thread_closes_the_socket_at_once(channel):
    sender, receiver = channel
    _connected(sender, receiver)
    receiver.close()
    assert receiver.pull.sock.closed


def test_a_receiver_whose_parent_is_not_rank_0_stops_waiting(tmp_path):
    sender = StepSender(tmp_path, 2)
    not_parent = os.getpid()  # never this process's own parent
    receiver = StepReceiver(rank_address(tmp_path, 1), parent_pid=not_parent)
    try:
        t, out = _recv_on_thread(receiver)
        t.join(WAKE_S)
        assert not t.is_alive() and f"rank 0 (pid {not_parent}) is gone" in out["closed"]
    finally:
        receiver.close()
        sender.close()
