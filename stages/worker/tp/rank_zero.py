"""The server worker as rank 0 of a tensor-parallel group (`--tensor-parallel-size N`): it starts ranks
1..N-1 (`serve_rank.py`), builds its own shard, and hands each step to the others before it runs it
(`RankZeroExecutor`). A slot is reported ready only once every rank's copy of it is done, since the
scheduler then lets the loader reuse the host block. A step that fails on rank 0 fails the stage: the
other ranks may already be inside its collectives, so the ranks cannot go on apart."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from proto.plan import BatchPlan, StepResult
from proto.tensor_parallel import BeginRun
from stages.worker.config import WorkerConfig
from stages.worker.executor import StepExecutor
from stages.worker.runner import ModelRunner, RunnerConfig
from stages.worker.tp.group import rank_device
from stages.worker.tp.ranks import RankFailed, RankProcesses

WATCH_S = 0.5  # how often the stage checks that its other ranks are alive


class RankZero:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.ranks: RankProcesses | None = None
        self.runner: ModelRunner | None = None

    def runner_config(self) -> RunnerConfig:
        """Rank 0's runner config; the other ranks get it with their own device. No adapter is copied
        layer by layer: a step waiting on per-layer copies takes another path than a step without
        (eager, or a gated graph of another padded size), and every rank must take the same path, or
        their collectives would not match; only rank 0 would have such copies in flight."""
        cfg = self.config.runner
        return dataclasses.replace(cfg, device=rank_device(cfg.device, 0), layered_min_bytes=None)

    def start(self) -> ModelRunner:
        """On the step thread (which must live as long as the stage: the ranks die with it)."""
        cfg = self.config
        rc = self.runner_config()
        self.ranks = RankProcesses(
            rc, cfg.tensor_parallel_size, "stages.worker.tp.serve_rank", host_pool_name=cfg.host_pool_name
        )
        self.runner = self.ranks.watch(lambda: ModelRunner(rc, tp=self.ranks.group))
        return self.runner

    def wrap(self, executor: StepExecutor) -> RankZeroExecutor:
        """On the step thread: the other ranks get their executors, and rank 0's steps go to them."""
        cfg = self.config
        self.ranks.send(
            BeginRun(max_model_len=cfg.max_model_len, seed=cfg.seed, overlap_loading=cfg.overlap_loading)
        )
        return RankZeroExecutor(executor, self.ranks)

    async def watch(self) -> None:
        """A stage loop: fail the stage when another rank exits."""
        while True:
            await asyncio.sleep(WATCH_S)
            if self.ranks is not None:
                self.ranks.check()

    def close(self) -> None:
        """On the step thread, at drain."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close(self.runner)


class RankZeroExecutor:
    """A `StepExecutor` whose launches and finishes every rank does too, in the same order (a step's
    finish travels with the next launch)."""

    def __init__(self, executor: StepExecutor, ranks: RankProcesses):
        self.executor, self.ranks = executor, ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)

    def launch(self, plan: BatchPlan):
        self.ranks.launch(plan)
        return self.executor.launch(plan)

    def finish(self, step):
        result, tokens = self.executor.finish(step)
        self.ranks.step_finished()
        if result.slots_ready:
            self.ranks.sync_copies()
        return result, tokens

    def execute(self, plan: BatchPlan):
        return self.finish(self.launch(plan))

    def poll_loads(self) -> list[int]:
        ready = self.executor.poll_loads()
        if ready:
            self.ranks.sync_copies()
        return ready

    def fail_step(self, plan: BatchPlan, message: str) -> StepResult:
        raise RankFailed(f"step {plan.step} failed on rank 0 of a tensor-parallel worker: {message}")
