"""A tensor-parallel rank other than 0 (its process: `runtime/tp_ranks.py`). It builds its shard of the
model, then does what rank 0 broadcasts, in rank 0's order (`proto/tensor_parallel.py`):
its forward's collectives meet rank 0's, its sampling matches rank 0's (the same logits, the same seeded
generators), and only rank 0 reports anything. It exits on `StopRanks`, when rank 0 leaves the group
(a collective fails), or when its parent dies."""

from __future__ import annotations

import collections
from collections.abc import Callable

import msgspec
import torch

from proto.codec import Codec
from proto.tensor_parallel import (
    AddAdapter,
    BeginRun,
    EndRun,
    FinishStep,
    LaunchStep,
    RankZeroToRanks,
    StopRanks,
)
from runtime.common.packed import PackedAdapter
from stages.worker.executor import StepExecutor
from stages.worker.lora.pool import runs_of
from stages.worker.runner import ModelRunner, RunnerConfig
from stages.worker.tp.group import TPGroup, TPSpec

ONE_FRAME = 1 << 62  # every buffer inline: a broadcast carries one frame


class FollowerConfig(msgspec.Struct, frozen=True, kw_only=True):
    runner: RunnerConfig  # this rank's (its device)
    spec: TPSpec
    parent_pid: int  # the process that started this rank (rank 0); its death ends this one


def rank_codec() -> Codec:
    return Codec(RankZeroToRanks, inline_max=ONE_FRAME)


class Follower:
    def __init__(self, cfg: FollowerConfig, read: Callable[[ModelRunner, AddAdapter], PackedAdapter]):
        """`read`: how this rank reads, checks and packs an adapter rank 0 added (in `host_layout`)."""
        self.cfg = cfg
        self.read = read
        self.group = TPGroup(cfg.spec, torch.device(cfg.runner.device))
        self.runner = ModelRunner(cfg.runner, tp=self.group)
        self.codec = rank_codec()
        self.adapters: dict[str, PackedAdapter] = {}
        self.executor: StepExecutor | None = None
        self.launched: collections.deque = collections.deque()

    def run(self) -> None:
        while True:
            msg = self.codec.decode([self.group.broadcast_bytes(None)])
            if isinstance(msg, StopRanks):
                return
            self.handle(msg)

    def handle(self, msg) -> None:
        if isinstance(msg, LaunchStep):
            self.launched.append(self.executor.launch(msg.plan))
        elif isinstance(msg, FinishStep):
            self.executor.finish(self.launched.popleft())
        elif isinstance(msg, AddAdapter):
            self.adapters[msg.name] = self.read(self.runner, msg)
        elif isinstance(msg, BeginRun):
            self.launched.clear()
            self.executor = StepExecutor(
                self.runner,
                self._load_slot,
                msg.max_model_len,
                seed=msg.seed,
                overlap_loading=msg.overlap_loading,
            )
        elif isinstance(msg, EndRun):
            self.executor, self.launched = None, collections.deque()

    def _load_slot(self, load) -> None:
        self.runner.load_adapter(
            load.slot, self.adapters[load.adapter], runs_of(load.row_starts, load.row_counts)
        )

    def close(self) -> None:
        self.group.close()
