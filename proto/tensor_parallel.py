"""Rank 0 of a tensor-parallel worker (offline engine or server) → its other ranks (a gloo broadcast,
msgspec-encoded, one frame): what every rank must do in the order rank 0 does it. Each step's plan
travels once, as the scheduler sent it (`LaunchStep`); `FinishStep` finishes the oldest step in flight."""

from __future__ import annotations

from proto.base import Message, edge
from proto.plan import BatchPlan


class LaunchStep(Message):
    """Launch this plan (as the scheduler sent it to rank 0)."""

    plan: BatchPlan


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


class FinishStep(Message):
    """Read the tokens of the oldest launched step (the sampling every rank did alike)."""


class EndRun(Message):
    """Drop the executor and its steps in flight."""


class StopRanks(Message):
    """Leave the group and exit."""


RankZeroToRanks = edge(
    "rank0_to_ranks", LaunchStep, FinishStep, SyncCopies, AddAdapter, BeginRun, EndRun, StopRanks
)
