"""The scheduler's adapter lifecycle without sockets: what it asks of the loader, what it tells the
tokenizer, and the pins it holds, driven by the loader's answers, adapter ops and slot reports."""

from __future__ import annotations

import asyncio
from typing import Any

from proto.loader import AdapterFailed, AdapterStaged, DropAdapter, ReleaseAdapter, StageAdapter
from proto.pipeline import AdapterUpdate, LoadAdapterOp, OpDone, OpFailed, UnloadAdapterOp
from proto.plan import SlotError, StepResult
from proto.sampling import SamplingParams
from runtime.base.actor import Mailbox
from runtime.base.endpoints import Endpoints
from runtime.base.metrics import StageMetrics
from stages.scheduler.adapter_lifecycle import AdapterLifecycle
from stages.scheduler.config import SchedulerConfig
from stages.scheduler.metrics import SchedulerMetrics
from stages.scheduler.planner import Planner, PlannerConfig

_EDGES = {f: "ipc://unused" for f in Endpoints.__struct_fields__ if f != "run_dir"}


def _staged(name: str, offset: int = 0) -> AdapterStaged:
    return AdapterStaged(name=name, shm_name="pool", offset=offset, nbytes=64, rank=4, layer_nbytes=32)


class Harness:
    def __init__(self, adapters: dict[str, str] | None = None, with_planner: bool = False) -> None:
        config = SchedulerConfig(
            endpoints=Endpoints(run_dir="", **_EDGES),
            max_loras_per_batch=2,
            max_model_len=64,
            adapters=adapters or {},
        )
        self.to_loader: Mailbox[Any] = Mailbox("to_loader", 64)
        self.to_tokenizer: Mailbox[Any] = Mailbox("to_tokenizer", 64)
        self.failed: list[tuple[str, str]] = []
        self.planner: Planner | None = None
        series = SchedulerMetrics(StageMetrics("scheduler"), lambda: self.planner, lambda: 0, lambda: {})
        self.life = AdapterLifecycle(config, self.to_loader, self.to_tokenizer, self._fail, series)
        if with_planner:
            cfg = PlannerConfig(num_slots=2, num_pages=16, page_size=16, max_model_len=64)
            ready, load_bytes = self.life.adapters.ready, self.life.load_bytes
            self.planner = self.life.planner = Planner(cfg, adapter_ready=ready, load_bytes=load_bytes)

    async def _fail(self, request_id: str, kind: str, message: str) -> None:
        self.failed.append((request_id, kind))

    @staticmethod
    def sent(box: Mailbox[Any]) -> list[Any]:
        out = []
        while not box.empty():
            out.append(box.get_nowait())
        return out


def test_load_op_is_validated_by_staging_and_its_spare_pin_released():
    async def main() -> None:
        h = Harness()
        await h.life.on_loader_started()
        await h.life.on_load_adapter_op(LoadAdapterOp(op_id=1, name="a", path="/a"))
        await h.life.on_load_adapter_op(LoadAdapterOp(op_id=2, name="a", path="/a"))  # joins the first
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]
        await h.life.on_adapter_staged(_staged("a"))
        assert h.sent(h.to_tokenizer) == [
            AdapterUpdate(name="a", state="registered"),
            OpDone(op_id=1),
            OpDone(op_id=2),
        ]
        assert h.sent(h.to_loader) == [ReleaseAdapter(name="a")]  # nothing waits for it
        e = h.life.adapters.get("a")
        assert e.state == "registered" and e.pins == 0 and e.staged is not None
        await h.life.on_load_adapter_op(LoadAdapterOp(op_id=3, name="a", path="/other"))
        [reply] = h.sent(h.to_tokenizer)
        assert isinstance(reply, OpFailed) and reply.kind == "invalid_request"

    asyncio.run(main())


def test_failed_load_op_registers_nothing():
    async def main() -> None:
        h = Harness()
        await h.life.on_loader_started()
        await h.life.on_load_adapter_op(LoadAdapterOp(op_id=7, name="bad", path="/bad"))
        await h.life.on_adapter_failed(AdapterFailed(name="bad", message="no adapter_config.json"))
        assert h.sent(h.to_tokenizer) == [
            OpFailed(op_id=7, kind="adapter_load_failed", message="no adapter_config.json"),
            AdapterUpdate(name="bad", state="removed"),
        ]
        assert h.life.adapters.get("bad") is None

    asyncio.run(main())


def test_slot_load_holds_a_pin_until_the_copy_is_reported_done():
    async def main() -> None:
        h = Harness({"a": "/a"}, with_planner=True)
        await h.life.on_loader_started()
        h.planner.add("x", [1, 2, 3], "a", SamplingParams(max_tokens=4))
        await h.life.stage_upcoming()
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]
        await h.life.on_adapter_staged(_staged("a", offset=128))
        assert h.sent(h.to_loader) == []  # the waiting request needs the pin
        plan = h.planner.schedule()
        [load] = [h.life.issue_load(lo) for lo in plan.slot_loads]
        assert (load.slot, load.adapter, load.shm_name, load.offset) == (0, "a", "pool", 128)
        assert h.life.adapters.get("a").loads_in_flight == 1
        h.planner.update(StepResult(step=plan.step, slots_ready=[0]))
        await h.life.after_step(StepResult(step=plan.step, slots_ready=[0]))
        assert h.sent(h.to_loader) == [ReleaseAdapter(name="a")]
        e = h.life.adapters.get("a")
        assert e.pins == 0 and e.loads_in_flight == 0 and not h.life.slot_loads
        assert h.life.tier_counts() == {"gpu": 1, "loading": 0, "host": 0, "disk": 0}

    asyncio.run(main())


def test_failed_slot_copy_fails_its_requests_and_releases_the_pin():
    async def main() -> None:
        h = Harness({"a": "/a"}, with_planner=True)
        await h.life.on_loader_started()
        h.planner.add("x", [1, 2, 3], "a", SamplingParams(max_tokens=4))
        await h.life.stage_upcoming()
        await h.life.on_adapter_staged(_staged("a"))
        plan = h.planner.schedule()
        for lo in plan.slot_loads:
            h.life.issue_load(lo)
        h.sent(h.to_loader)
        res = StepResult(step=plan.step, slot_errors=[SlotError(slot=0, adapter="a", message="boom")])
        h.planner.update(res)
        await h.life.after_step(res)
        assert h.failed == [("x", "adapter_load_failed")]
        assert h.sent(h.to_loader) == [ReleaseAdapter(name="a")]
        assert h.planner.slots.slot_of("a") is None

    asyncio.run(main())


def test_loader_restart_asks_again_for_unanswered_stages():
    async def main() -> None:
        h = Harness({"a": "/a"}, with_planner=True)
        await h.life.on_loader_started()
        h.planner.add("x", [1, 2, 3], "a", SamplingParams(max_tokens=4))
        await h.life.stage_upcoming()
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]
        await h.life.on_loader_started()  # the loader died before answering
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]
        assert h.life.adapters.generation == 2

    asyncio.run(main())


def test_unload_drops_the_adapter_once_unused():
    async def main() -> None:
        h = Harness({"a": "/a"})
        await h.life.on_unload_adapter_op(UnloadAdapterOp(op_id=4, name="a"))
        assert h.sent(h.to_tokenizer) == [AdapterUpdate(name="a", state="unloading"), OpDone(op_id=4)]
        assert await h.life.finish_unloads() == []
        assert h.sent(h.to_loader) == [DropAdapter(name="a")]
        assert h.sent(h.to_tokenizer) == [AdapterUpdate(name="a", state="removed")]
        assert h.life.adapters.get("a") is None
        await h.life.on_unload_adapter_op(UnloadAdapterOp(op_id=5, name="a"))
        [reply] = h.sent(h.to_tokenizer)
        assert isinstance(reply, OpFailed) and reply.kind == "unknown_adapter"

    asyncio.run(main())
