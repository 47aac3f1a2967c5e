"""The worker's kernel warm-up progress in the scheduler's health answer: the latest WarmupProgress while
the warm-up runs (steps done of the total, in the worker's StageHealth and its detail), nothing once the
worker has started."""

from __future__ import annotations

import asyncio

from proto.plan import WarmupProgress, WorkerStarted
from runtime.base.endpoints import Endpoints
from stages.scheduler.actor import SchedulerActor
from stages.scheduler.config import SchedulerConfig


def _worker(actor: SchedulerActor):
    (worker,) = [s for s in actor._health() if s.stage == "worker"]
    return worker


def test_health_reports_the_warm_up_until_the_worker_starts(tmp_path):
    ep = Endpoints.in_run_dir(tmp_path)
    actor = SchedulerActor(
        SchedulerConfig(
            endpoints=ep, host_cache_bytes=1 << 20, max_block_bytes=1 << 16, adapter_wait_timeout_s=5.0,
            max_model_len=64,
        )
    )  # fmt: skip
    before = _worker(actor)
    assert (before.warmup_done, before.warmup_total) == (0, 0) and before.status == "degraded"

    async def main() -> None:
        await actor.handle(WarmupProgress(done=3, total=140))
        first = _worker(actor)
        await actor.handle(WarmupProgress(done=97, total=140))
        second = _worker(actor)
        await actor.handle(
            WorkerStarted(
                num_pages=64, page_size=16, max_model_len=64, lora_rows=64, lora_ids=4, lora_row_bytes=64
            )
        )
        return first, second, _worker(actor)

    first, second, started = asyncio.run(main())
    assert (first.warmup_done, first.warmup_total, first.status) == (3, 140, "degraded")
    assert first.detail == "warming up: 3/140 kernel variants compiled or loaded"
    assert (second.warmup_done, second.warmup_total) == (97, 140)
    assert (started.warmup_done, started.warmup_total) == (0, 0) and "warming up" not in started.detail
