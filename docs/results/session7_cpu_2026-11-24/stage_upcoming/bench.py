"""The scheduler's staging pass (AdapterLifecycle.stage_upcoming) with 1,000 registered adapters, 300
waiting requests on distinct adapters, 63 host blocks held for loads not yet issued (one under the cap
of 64) and the other 237 refused for host room: every name is walked each call. Run from a tree root:
PYTHONPATH=TREE python bench.py"""

import asyncio
import time

from proto.loader import AdapterStaged
from proto.sampling import SamplingParams
from runtime.base.actor import Mailbox
from runtime.base.metrics import StageMetrics
from stages.scheduler.adapter_lifecycle import AdapterLifecycle
from stages.scheduler.adapters import AdapterRegistry
from stages.scheduler.metrics import HOLD_STATES, TIERS, WAITING_TIERS, SchedulerMetrics
from stages.scheduler.planner import Planner, PlannerConfig


async def main():
    names = {f"a{i}": f"/p/a{i}" for i in range(1000)}
    reg = AdapterRegistry(names)
    series = SchedulerMetrics(
        StageMetrics("scheduler"),
        lambda: None,
        lambda: 0,
        lambda: dict.fromkeys(TIERS, 0),
        lambda: dict.fromkeys(WAITING_TIERS, 0),
        lambda: dict.fromkeys(HOLD_STATES, 0),
    )
    box = Mailbox("to_loader", 100000)

    async def fail(*a):
        pass

    life = AdapterLifecycle(reg, box, fail, series, None, 64)
    life.loader_up = True
    cfg = PlannerConfig(
        num_pages=4096, page_size=16, pool_rows=2900, pool_ids=256, max_model_len=2048, max_lora_rank=64
    )
    planner = Planner(cfg, adapter_rows=reg.rows, adapter_ready=reg.ready)
    for i in range(300):
        planner.add(f"r{i}", [1] * 10, f"a{i}", SamplingParams(max_tokens=4))
    for i in range(63):  # held, no load issued: held_waiting 63 < 64, so the loop walks every name
        e = reg.get(f"a{i}")
        e.staged = AdapterStaged(name=e.name, shm_name="p", offset=0, nbytes=64, rank=8, layer_nbytes=4)
        e.held = True
    for i in range(63, 300):
        reg._blocked.add(f"a{i}")  # refused for host room: not asked again
    t0 = time.perf_counter()
    n = 200
    for _ in range(n):
        await life.stage_upcoming(planner)
    print(f"stage_upcoming {1e3 * (time.perf_counter() - t0) / n:.2f} ms per call")


asyncio.run(main())
