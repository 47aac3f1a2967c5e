"""A tensor-parallel rank other than 0 (its process: `runtime/tp_ranks.py` for the offline engine,
`tp/serve_rank.py` for the server's worker). It builds its shard of the model, then does what rank 0
hands over (`tp/channel.py`, `proto/tensor_parallel.py`), in rank 0's order: its forward's collectives
meet rank 0's, its sampling matches rank 0's (the same logits, the same seeded generators), and only
rank 0 reports anything. It exits on `StopRanks`, when rank 0 leaves the group (a collective fails), or
when rank 0's process dies (the kernel's parent-death signal, SIGKILL; the channel's check of its
parent)."""

from __future__ import annotations

import collections
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from proto.plan import SlotLoad
from proto.tensor_parallel import AddAdapter, BeginRun, EndRun, LaunchStep, StopRanks, SyncCopies
from runtime.base.parent_death import arm
from runtime.common.host_pool import attach_pool, packed_from_pool, register_pinned
from runtime.common.packed import PackedAdapter
from stages.worker.executor import StepExecutor
from stages.worker.lora.pool import runs_of
from stages.worker.runner import ModelRunner, RunnerConfig
from stages.worker.tp.channel import StepReceiver
from stages.worker.tp.group import TPGroup, TPSpec

log = logging.getLogger("lorapipe.tp")

Read = Callable[[ModelRunner, AddAdapter], PackedAdapter]  # an adapter rank 0 added, from its files


class FollowerConfig(msgspec.Struct, frozen=True, kw_only=True):
    runner: RunnerConfig  # this rank's (its device)
    spec: TPSpec
    parent_pid: int  # the process that started this rank (rank 0); its death ends this one
    channel: str  # rank 0's socket for this rank (`tp/channel.py`)
    host_pool_name: str | None = None  # the server's shared host cache (None: the offline engine)


def sync_copies(group: TPGroup) -> None:
    """Every rank's adapter copies issued so far are done once this returns on every rank (each waits for
    its device, then all meet in a barrier)."""
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    dist.barrier(group=group.control)


def release_graphs(runner: ModelRunner) -> None:
    """Drop the runner's CUDA graphs and wait for its device: a graph that captured a collective keeps
    the group's communicator busy, and a graceful teardown would wait on it. The runner runs no step
    after this."""
    runner.graphs = None
    runner.step_graphs = None
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


class HostBlocks:
    """The server's shared host cache, mapped (and pinned on CUDA) at the first load, as the worker
    maps it: a slot load's packed adapter is the block the loader wrote."""

    def __init__(self, name: str):
        self.name = name
        self.pool = None

    def __call__(self, runner: ModelRunner, load: SlotLoad) -> PackedAdapter:
        if self.pool is None:
            self.pool = attach_pool(self.name)
            if runner.device.type == "cuda":
                register_pinned(self.pool)
        return packed_from_pool(self.pool, load, runner.host_layout, runner.dtype)


class Follower:
    def __init__(self, cfg: FollowerConfig, read: Read | None = None):
        """A slot load's packed adapter (in `host_layout`) comes from the server's host cache
        (`cfg.host_pool_name`), or from what `read` made of an adapter rank 0 added (offline engine)."""
        self.read = read
        self.host = HostBlocks(cfg.host_pool_name) if cfg.host_pool_name is not None else None
        self.rank = cfg.spec.rank
        # connected first: the connection is made while the group forms
        self.channel = StepReceiver(cfg.channel, cfg.parent_pid)
        self.group = TPGroup(cfg.spec, torch.device(cfg.runner.device))
        self.runner = ModelRunner(cfg.runner, tp=self.group)
        self.adapters: dict[str, PackedAdapter] = {}
        self.executor: StepExecutor | None = None
        self.launched: collections.deque = collections.deque()
        self.launches = 0  # steps of this run launched
        self.finished = 0  # steps of this run finished (rank 0's count arrives with each launch)
        self.idle_s = 0.0  # seconds of this run spent waiting for rank 0's next message

    def run(self) -> None:
        while True:
            # Rank 0 launches with at most one earlier step unfinished: any older one it finishes before
            # its next launch, and so may this rank, while it waits for that launch.
            while len(self.launched) > 1:
                self._finish_oldest()
            start = time.perf_counter()
            msg = self.channel.recv()
            self.idle_s += time.perf_counter() - start
            if isinstance(msg, StopRanks):
                return
            self.handle(msg)

    def handle(self, msg) -> None:
        match msg:
            case LaunchStep(plan=plan, finished=finished):
                while self.finished < finished:
                    self._finish_oldest()
                if self.finished > finished:
                    raise RuntimeError(f"rank {self.rank} finished {self.finished} steps, rank 0 {finished}")
                self.launched.append(self.executor.launch(plan))
                self.launches += 1
            case SyncCopies():
                sync_copies(self.group)
            case AddAdapter(name=name):
                self.adapters[name] = self.read(self.runner, msg)
            case BeginRun():
                self._end_run()
                self.executor = StepExecutor(
                    self.runner,
                    self._load_slot,
                    msg.max_model_len,
                    seed=msg.seed,
                    overlap_loading=msg.overlap_loading,
                )
                self.executor.guided.prepare()  # as rank 0's: no rank waits for it at a first grammar
            case EndRun():
                self._end_run()

    def _finish_oldest(self) -> None:
        if not self.launched:
            raise RuntimeError(f"rank 0 finished a step rank {self.rank} never launched")
        self.executor.finish(self.launched.popleft())
        self.finished += 1

    def _end_run(self) -> None:
        """Drop the executor and its steps in flight, logging this run's host time per step (what each
        rank spends on a step beside rank 0's, `executor.phase_seconds`)."""
        if self.launches:
            n = self.launches
            per = {k: round(v / n * 1e6) for k, v in self.executor.phase_seconds.items()}
            log.info("run of %d steps: host us per step %s, waiting for rank 0 %d", n, per,
                     round(self.idle_s / n * 1e6))  # fmt: skip
        self.executor, self.launched = None, collections.deque()
        self.launches, self.finished, self.idle_s = 0, 0, 0.0

    def _load_slot(self, load: SlotLoad) -> None:
        """The copy goes on the compute stream, ahead of the step's forward (and of its collectives,
        which rank 0's step then waits for)."""
        packed = self.host(self.runner, load) if self.host is not None else self.adapters[load.adapter]
        self.runner.load_adapter(load.slot, packed, runs_of(load.row_starts, load.row_counts))

    def close(self) -> None:
        """Stopped by rank 0 (`StopRanks`): every rank leaves the group together."""
        self._end_run()
        self.channel.close()
        gc.unfreeze()  # what `run_rank` froze may hold a graph in a cycle, which only a collection frees
        release_graphs(self.runner)
        self.group.announce_leaving()
        self.group.close(graceful=True)


def run_rank(argv: list[str], read: Read | None = None) -> int:
    """A rank process's main: `argv[1]` is its FollowerConfig (JSON)."""
    cfg = msgspec.json.decode(Path(argv[1]).read_bytes(), type=FollowerConfig)
    fmt = f"%(asctime)s tp-rank{cfg.spec.rank} %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    # This rank dies with rank 0's process, even blocked in a collective (the thread that started it
    # must outlive it, as PR_SET_PDEATHSIG follows the spawning thread).
    if not arm(signal.SIGKILL, cfg.parent_pid):
        log.error("rank 0 (pid %d) exited before rank %d started", cfg.parent_pid, cfg.spec.rank)
        return 1
    follower = Follower(cfg, read)
    # What setup made lives as long as the rank, as in the worker stage (rank 0): a full collection
    # walking the model, its kernels and graphs would stall this rank's steps, and rank 0's with them.
    gc.collect()
    gc.freeze()
    follower.run()  # an error propagates: the rank exits non-zero and rank 0 reports it
    follower.close()
    # Stopped by rank 0: leave now, without the interpreter's teardown, whose CUDA and NCCL destructors
    # can wait on ranks that have already gone.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
