"""Rank 0 of a tensor-parallel worker (offline engine or server) → its other ranks (ZeroMQ PUSH/PULL over
ipc, msgspec-encoded, one frame: `stages/worker/tp/channel.py`): what every rank must do in the order rank
0 does it. A step is one message: its plan, as the scheduler sent it, and how many steps rank 0 had
finished before launching it (finishing sends nothing)."""

from __future__ import annotations

from proto.base import Message, edge
from proto.plan import BatchPlan


class LaunchStep(Message):
    """Finish the oldest launched steps until `finished` steps of this run are, then launch this plan (as
    the scheduler sent it to rank 0). Rank 0 launches with at most one earlier step unfinished, so a
    rank may finish any step older than its latest launch before this arrives."""

    plan: BatchPlan
    finished: int = 0  # steps rank 0 had finished since its BeginRun when it launched this one


class SyncCopies(Message):
    """Wait until this rank's adapter copies are done, then meet the others (rank 0 reports a slot ready
    only after every rank has copied it)."""


class AddAdapter(Message):
    """Read, check and pack an adapter (rank 0 already did, so the files are good)."""

    name: str
    path: str


class BeginRun(Message):
    """A fresh step executor: an offline `generate` call, or the worker's start."""

    max_model_len: int
    seed: int = 0
    overlap_loading: bool = True


class EndRun(Message):
    """Drop the executor and its steps in flight."""


# From StopRanks until every other rank has exited; a rank still running then is killed. Rank 0's close
# takes at most this long, which the launcher allows a stopping tensor-parallel worker on top of its own.
STOP_RANKS_TIMEOUT_S = 10.0


class StopRanks(Message):
    """Leave the group and exit (within STOP_RANKS_TIMEOUT_S)."""


RankZeroToRanks = edge("rank0_to_ranks", LaunchStep, SyncCopies, AddAdapter, BeginRun, EndRun, StopRanks)
