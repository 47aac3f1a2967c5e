"""The scheduler's adapter lifecycle and ops without sockets: what they ask of the loader, what they tell
the tokenizer, and the holds the scheduler keeps on host blocks (at most one per adapter: the loader
only mirrors held/not held), driven by the loader's answers, adapter ops and pool-load reports."""

from __future__ import annotations

import asyncio
from typing import Any

from proto.loader import AdapterFailed, AdapterStaged, DropAdapter, ReleaseAdapter, StageAdapter
from proto.pipeline import AdapterUpdate, LoadAdapterOp, OpDone, OpFailed, UnloadAdapterOp
from proto.plan import SlotError, StepResult
from proto.sampling import SamplingParams
from runtime.base.actor import Mailbox
from runtime.base.metrics import StageMetrics
from stages.scheduler.adapter_lifecycle import AdapterLifecycle
from stages.scheduler.adapter_ops import AdapterOps
from stages.scheduler.adapters import AdapterRegistry, AdapterState
from stages.scheduler.metrics import SchedulerMetrics
from stages.scheduler.planner import Planner, PlannerConfig


def _staged(name: str, offset: int = 0) -> AdapterStaged:
    return AdapterStaged(name=name, shm_name="pool", offset=offset, nbytes=64, rank=4, layer_nbytes=32)


class Harness:
    def __init__(self, adapters: dict[str, str] | None = None, with_planner: bool = False) -> None:
        self.to_loader: Mailbox[Any] = Mailbox("to_loader", 64)
        self.to_tokenizer: Mailbox[Any] = Mailbox("to_tokenizer", 64)
        self.failed: list[tuple[str, str]] = []
        self.planner: Planner | None = None
        self.adapters = AdapterRegistry(adapters or {})
        series = SchedulerMetrics(
            StageMetrics("scheduler"), lambda: self.planner, lambda: 0, lambda: {}, lambda: {}, lambda: {}
        )
        self.life = AdapterLifecycle(self.adapters, self.to_loader, self._fail, series, 8, 2)
        self.ops = AdapterOps(self.adapters, self.life, self.to_tokenizer, self._fail)
        if with_planner:
            cfg = PlannerConfig(
                num_pages=16, page_size=16, pool_rows=8, pool_ids=2, max_model_len=64, max_lora_rank=4
            )
            self.planner = Planner(
                cfg,
                adapter_rows=self.adapters.rows,
                adapter_ready=self.adapters.ready,
                load_bytes=self.life.load_bytes,
            )

    async def staged(self, msg: AdapterStaged) -> None:
        """What the actor does with an AdapterStaged."""
        await self.ops.on_adapter_staged(msg)
        await self.life.on_adapter_staged(msg, self.planner)

    async def _fail(self, request_id: str, kind: str, message: str) -> None:
        self.failed.append((request_id, kind))

    @staticmethod
    def sent(box: Mailbox[Any]) -> list[Any]:
        out = []
        while not box.empty():
            out.append(box.get_nowait())
        return out


def test_load_op_is_validated_by_staging_and_its_unneeded_hold_released():
    async def main() -> None:
        h = Harness()
        await h.life.on_loader_started()
        await h.ops.on_load_adapter_op(LoadAdapterOp(op_id=1, name="a", path="/a"))
        await h.ops.on_load_adapter_op(LoadAdapterOp(op_id=2, name="a", path="/a"))  # joins the first
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]
        await h.staged(_staged("a"))
        assert h.sent(h.to_tokenizer) == [
            AdapterUpdate(name="a", state="registered"),
            OpDone(op_id=1),
            OpDone(op_id=2),
        ]
        assert h.sent(h.to_loader) == [ReleaseAdapter(name="a")]  # nothing waits for it
        e = h.adapters.get("a")
        assert e.state is AdapterState.REGISTERED and not e.held and e.staged is not None
        await h.ops.on_load_adapter_op(LoadAdapterOp(op_id=3, name="a", path="/other"))
        [reply] = h.sent(h.to_tokenizer)
        assert isinstance(reply, OpFailed) and reply.kind == "invalid_request"

    asyncio.run(main())


def test_failed_load_op_registers_nothing():
    async def main() -> None:
        h = Harness()
        await h.life.on_loader_started()
        await h.ops.on_load_adapter_op(LoadAdapterOp(op_id=7, name="bad", path="/bad"))
        await h.ops.on_adapter_failed(AdapterFailed(name="bad", message="no adapter_config.json"), None)
        assert h.sent(h.to_tokenizer) == [
            OpFailed(op_id=7, kind="adapter_load_failed", message="no adapter_config.json"),
            AdapterUpdate(name="bad", state="removed"),
        ]
        assert h.adapters.get("bad") is None

    asyncio.run(main())


def test_pool_load_holds_the_block_until_the_copy_is_reported_done():
    async def main() -> None:
        h = Harness({"a": "/a"}, with_planner=True)
        await h.life.on_loader_started()
        h.planner.add("x", [1, 2, 3], "a", SamplingParams(max_tokens=4))
        h.planner.add("y", [1, 2], "a", SamplingParams(max_tokens=4))
        h.planner.add("z", [1], None, SamplingParams(max_tokens=4))
        tiers = h.ops.waiting_tiers(h.planner)
        assert (tiers["disk"], tiers["base"], sum(tiers.values())) == (2, 1, 3)
        await h.life.stage_upcoming(h.planner)
        await h.life.stage_upcoming(h.planner)
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]  # one hold for both requests
        assert h.ops.waiting_tiers(h.planner)["asked"] == 2
        assert h.ops.hold_counts() == {"waiting": 1, "held": 0, "asked": 1, "refused": 0}
        await h.staged(_staged("a", offset=128))
        assert h.sent(h.to_loader) == []  # the waiting requests need the block
        assert h.ops.waiting_tiers(h.planner)["host"] == 2
        assert h.ops.hold_counts() == {"waiting": 1, "held": 1, "asked": 0, "refused": 0}
        plan = h.planner.schedule()
        [load] = [h.life.issue_load(lo) for lo in plan.slot_loads]
        assert (load.slot, load.adapter, load.shm_name, load.offset) == (0, "a", "pool", 128)
        assert (load.row_starts, load.row_counts) == ([0], [4])
        assert h.adapters.get("a").loads_in_flight == 1
        h.planner.update(StepResult(step=plan.step, slots_ready=[0]))
        await h.life.after_step(StepResult(step=plan.step, slots_ready=[0]), h.planner)
        assert h.sent(h.to_loader) == [ReleaseAdapter(name="a")]
        e = h.adapters.get("a")
        assert not e.held and e.loads_in_flight == 0 and not h.life.pool_loads
        assert h.ops.tier_counts(h.planner) == {"gpu": 1, "loading": 0, "host": 0, "disk": 0}

    asyncio.run(main())


def test_a_load_op_hold_is_kept_for_a_request_waiting_on_it():
    """A request that comes while its adapter's load op validates uses that very hold: no
    ReleaseAdapter, StageAdapter, AdapterStaged round trip before its pool load."""

    async def main() -> None:
        h = Harness(with_planner=True)
        await h.life.on_loader_started()
        await h.ops.on_load_adapter_op(LoadAdapterOp(op_id=1, name="a", path="/a"))
        h.planner.add("x", [1, 2, 3], "a", SamplingParams(max_tokens=4))
        await h.staged(_staged("a"))
        await h.life.stage_upcoming(h.planner)
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]  # the op's, and nothing since
        plan = h.planner.schedule()
        assert [lo.adapter for lo in plan.slot_loads] == ["a"]

    asyncio.run(main())


def test_failed_pool_copy_fails_its_requests_and_releases_the_hold():
    async def main() -> None:
        h = Harness({"a": "/a"}, with_planner=True)
        await h.life.on_loader_started()
        h.planner.add("x", [1, 2, 3], "a", SamplingParams(max_tokens=4))
        await h.life.stage_upcoming(h.planner)
        await h.staged(_staged("a"))
        plan = h.planner.schedule()
        for lo in plan.slot_loads:
            h.life.issue_load(lo)
        h.sent(h.to_loader)
        res = StepResult(step=plan.step, slot_errors=[SlotError(slot=0, adapter="a", message="boom")])
        h.planner.update(res)
        await h.life.after_step(res, h.planner)
        assert h.failed == [("x", "adapter_load_failed")]
        assert h.sent(h.to_loader) == [ReleaseAdapter(name="a")]
        assert h.planner.pool.get("a") is None and h.planner.pool.rows.num_free == 8

    asyncio.run(main())


def test_loader_restart_asks_again_for_unanswered_stages():
    async def main() -> None:
        h = Harness({"a": "/a"}, with_planner=True)
        await h.life.on_loader_started()
        h.planner.add("x", [1, 2, 3], "a", SamplingParams(max_tokens=4))
        await h.life.stage_upcoming(h.planner)
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]
        await h.life.on_loader_started()  # the loader died before answering
        assert h.sent(h.to_loader) == [StageAdapter(name="a", path="/a")]
        assert h.adapters.generation == 2

    asyncio.run(main())


def test_unload_drops_the_adapter_once_unused():
    async def main() -> None:
        h = Harness({"a": "/a"})
        await h.ops.on_unload_adapter_op(UnloadAdapterOp(op_id=4, name="a"))
        assert h.sent(h.to_tokenizer) == [AdapterUpdate(name="a", state="unloading"), OpDone(op_id=4)]
        assert await h.ops.finish_unloads(None) == []
        assert h.sent(h.to_loader) == [DropAdapter(name="a")]
        assert h.sent(h.to_tokenizer) == [AdapterUpdate(name="a", state="removed")]
        assert h.adapters.get("a") is None
        await h.ops.on_unload_adapter_op(UnloadAdapterOp(op_id=5, name="a"))
        [reply] = h.sent(h.to_tokenizer)
        assert isinstance(reply, OpFailed) and reply.kind == "unknown_adapter"

    asyncio.run(main())


def test_a_load_during_an_unload_keeps_the_adapter():
    """A router that evicts an adapter from its cache and loads it again at once (Ray Serve's multiplexing
    does) may send the load before the unload has finished: with the same path the adapter stays; with
    another the op fails, naming the unload in progress."""

    async def main() -> None:
        h = Harness({"a": "/a"})
        await h.ops.on_unload_adapter_op(UnloadAdapterOp(op_id=1, name="a"))
        assert h.sent(h.to_tokenizer) == [AdapterUpdate(name="a", state="unloading"), OpDone(op_id=1)]
        await h.ops.on_load_adapter_op(LoadAdapterOp(op_id=2, name="a", path="/a"))
        assert h.sent(h.to_tokenizer) == [AdapterUpdate(name="a", state="registered"), OpDone(op_id=2)]
        assert h.adapters.get("a").state is AdapterState.REGISTERED
        assert await h.ops.finish_unloads(None) == [] and h.sent(h.to_loader) == []  # nothing dropped
        await h.ops.on_unload_adapter_op(UnloadAdapterOp(op_id=3, name="a"))
        h.sent(h.to_tokenizer)
        await h.ops.on_load_adapter_op(LoadAdapterOp(op_id=4, name="a", path="/elsewhere"))
        [reply] = h.sent(h.to_tokenizer)
        assert isinstance(reply, OpFailed) and reply.kind == "invalid_request"
        assert reply.message == "adapter 'a' (from /a) is still being unloaded; load it again once it is gone"
        assert await h.ops.finish_unloads(None) == []
        assert h.sent(h.to_loader) == [DropAdapter(name="a")]

    asyncio.run(main())


def test_staging_stops_at_each_cap_and_resumes_when_a_load_is_issued():
    """Holds asked for loads not yet issued stop at `max_held_waiting` (2 here) and all holds at
    `max_held`; issuing a pool load frees a place among the first, so the next adapter is asked for."""

    async def main() -> None:
        names = {n: f"/{n}" for n in "abcde"}
        h = Harness(names, with_planner=True)
        await h.life.on_loader_started()
        for i, n in enumerate(names):
            h.planner.add(f"r{i}", [1, 2], n, SamplingParams(max_tokens=2))
        await h.life.stage_upcoming(h.planner)
        assert [m.name for m in h.sent(h.to_loader)] == ["a", "b"]
        await h.life.stage_upcoming(h.planner)
        assert h.sent(h.to_loader) == []
        await h.staged(_staged("a"))
        await h.staged(_staged("b", offset=64))
        plan = h.planner.schedule()  # the pool (8 rows, 2 ids) takes a and b
        assert sorted(lo.adapter for lo in plan.slot_loads) == ["a", "b"]
        for lo in plan.slot_loads:
            h.life.issue_load(lo)
        await h.life.stage_upcoming(h.planner)
        assert [m.name for m in h.sent(h.to_loader)] == ["c", "d"]
        h.life.max_held_waiting, h.life.max_held = 100, 4  # a, b, c, d held or asked: at the cap
        await h.life.stage_upcoming(h.planner)
        assert h.sent(h.to_loader) == []
        h.life.max_held = 5
        await h.life.stage_upcoming(h.planner)
        assert [m.name for m in h.sent(h.to_loader)] == ["e"]

    asyncio.run(main())
