"""Planner invariants with overlapped loading and prefetch under slot pressure, against a simulated
worker that reports a slot ready one step after its load: a slot a running request references is
never a load target, a request runs only on a slot its adapter was copied into (possibly still in
flight: the worker gates each layer on its copy), a step never needs more adapters than slots, pinned
adapters stay resident, and everything finishes without leaks."""

from __future__ import annotations

import random

import pytest

from proto.plan import FinishedRequest, StepResult
from proto.sampling import SamplingParams
from stages.scheduler.planner import Planner, PlannerConfig

pytestmark = pytest.mark.timeout(60)


class DelayedReadyWorker:
    """Runs plans like the worker would and reports each load's slot ready one step later."""

    def __init__(self, planner: Planner, overlap: bool):
        self.planner, self.overlap = planner, overlap
        self.state: dict[str, dict] = {}
        self.pending: list[int] = []  # loaded in the previous step, reported in this one
        self.ready: set[int] = set()  # slots reported ready and not loaded since
        self.loaded: dict[int, str] = {}

    def run(self, plan) -> StepResult:
        cfg = self.planner.cfg
        report, self.pending = self.pending, []
        active_before = {st["slot"] for st in self.state.values() if st["active"]}
        for load in plan.slot_loads:
            assert load.slot not in active_before, f"slot {load.slot} loaded while a running request uses it"
            others = [
                r.request_id
                for r in self.planner.running
                if r.slot == load.slot and r.adapter != load.adapter
            ]
            assert not others, f"slot {load.slot} is loaded while {others} use it"
            assert load.adapter not in self.loaded.values() or self.loaded.get(load.slot) == load.adapter
            if self.loaded.get(load.slot) in cfg.pinned_adapters:
                raise AssertionError(f"pinned adapter {self.loaded[load.slot]} evicted")
            self.loaded[load.slot] = load.adapter
            self.ready.discard(load.slot)
            self.pending.append(load.slot)
            if not self.overlap:
                self.ready.add(load.slot)  # synchronous: the step waits for the copy
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        for rid in plan.preempted_request_ids:
            self.state[rid].update(computed=0, active=False)
        counts = {}
        for n in plan.new_requests:
            prompt = n.prompt_ids.tolist()
            self.state[n.request_id] = dict(
                tokens=len(prompt),
                prompt=len(prompt),
                computed=0,
                active=True,
                max_tokens=n.sampling.max_tokens,
                slot=n.slot,
                adapter=self.planner._by_id[n.request_id].adapter,
            )
            counts[n.request_id] = n.num_scheduled_tokens
        for c in plan.cached_requests:
            st = self.state[c.request_id]
            if c.resumed:
                st.update(active=True, slot=c.slot)
            counts[c.request_id] = c.num_scheduled_tokens
        finished, slots_in_step = [], set()
        for rid, st in self.state.items():
            if not st["active"]:
                continue
            if st["slot"] >= 0:
                slots_in_step.add(st["slot"])
                assert self.loaded.get(st["slot"]) == st["adapter"], (
                    f"{rid} runs on slot {st['slot']}, which holds {self.loaded.get(st['slot'])!r}"
                )
            st["computed"] += counts.get(rid, 1)
            if st["computed"] == st["tokens"]:
                st["tokens"] += 1
                if st["tokens"] - st["prompt"] >= st["max_tokens"] or st["tokens"] >= cfg.max_model_len:
                    st["active"] = False
                    finished.append(FinishedRequest(request_id=rid, reason="length", num_output_tokens=0))
        assert len(slots_in_step) <= cfg.num_slots, "a step needs more adapters than slots"
        if self.overlap:
            self.ready.update(report)
        return StepResult(step=plan.step, finished=finished, slots_ready=report if self.overlap else [])


def _drive(cfg: PlannerConfig, rng: random.Random, adapters: list, n: int) -> Planner:
    planner = Planner(cfg)
    worker = DelayedReadyWorker(planner, cfg.overlap_loading)
    # bursty phases: runs of requests for a few adapters, then the next few
    phase = 0
    for i in range(n):
        if i % 8 == 0:
            phase = rng.randrange(len(adapters))
        name = adapters[(phase + rng.randrange(3)) % len(adapters)]
        prompt = [1] * rng.randint(1, min(20, cfg.max_model_len - 1))
        planner.add(f"r{i}", prompt, name, SamplingParams(max_tokens=rng.randint(1, 8)))
    steps = 0
    while planner.has_work:
        steps += 1
        assert steps < 3000, "planner made no progress"
        if steps == 4:
            planner.abort("r5")
        plan = planner.schedule()
        for r in planner.running:  # one adapter per slot: never more adapters than slots in a step
            assert r.slot < 0 or planner.slots.slots[r.slot].adapter == r.adapter, (
                "admitted onto a foreign slot"
            )
        planner.update(worker.run(plan))
        for i, s in enumerate(planner.slots.slots):
            assert s.refs == sum(1 for r in planner.running if r.slot == i)
    assert planner.pages.num_free == cfg.num_pages, "KV pages leaked"
    assert all(s.refs == 0 for s in planner.slots.slots), "slot references leaked"
    return planner


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("overlap,depth", [(True, 0), (True, 8), (False, 8), (True, 2)])
def test_slot_pressure_keeps_invariants(seed, overlap, depth):
    rng = random.Random(seed)
    num_slots = rng.choice([1, 2, 3])
    num_pages, page_size = rng.choice([16, 40]), rng.choice([2, 4])
    cfg = PlannerConfig(
        num_slots=num_slots,
        num_pages=num_pages,
        page_size=page_size,
        max_running_requests=rng.choice([2, 4, 8]),
        max_tokens_per_step=rng.choice([8, 16, 64]),
        max_model_len=min(48, num_pages * page_size),
        pinned_adapters=("a0",) if num_slots > 1 and seed % 2 else (),
        overlap_loading=overlap,
        prefetch_depth=depth,
    )
    adapters = [None] + [f"a{i}" for i in range(4 * num_slots)]  # four times more adapters than slots
    planner = _drive(cfg, rng, adapters, 40)
    assert planner.stats.adapter_loads > 0


def _two_slot_overlap_cfg(**changes) -> PlannerConfig:
    """Two slots, overlap on, room for every request of the small scenarios below."""
    base = dict(num_slots=2, num_pages=64, page_size=16, max_tokens_per_step=64, max_model_len=256,
                overlap_loading=True)  # fmt: skip
    return PlannerConfig(**{**base, **changes})


def _plan_ids(plan):
    return [r.request_id for r in plan.new_requests]


def test_overlap_admits_requests_in_the_step_of_their_load():
    """A request whose adapter must be loaded runs in the very plan that issues the load (the worker
    gates each layer on its copy); the slot stays loading, so no victim choice touches it, until the
    worker reports it ready, while resident and base-only requests run beside it."""
    cfg = _two_slot_overlap_cfg()
    planner = Planner(cfg)
    planner.add("x", [1, 2], "a", SamplingParams(max_tokens=9))
    p1 = planner.schedule()
    assert _plan_ids(p1) == ["x"] and [(lo.slot, lo.adapter) for lo in p1.slot_loads] == [(0, "a")]
    assert planner.slots.is_loading(0) and planner.slots.slots[0].refs == 1
    planner.update(StepResult(step=p1.step, slots_ready=[0]))
    assert not planner.slots.is_loading(0)
    planner.add("y", [1, 2], "b", SamplingParams(max_tokens=9))
    planner.add("z", [1, 2], None, SamplingParams(max_tokens=9))
    planner.add("w", [1, 2], "c", SamplingParams(max_tokens=9))
    p2 = planner.schedule()
    # x decodes on its resident slot, y joins with b's load, z is base-only; c has no slot to go to
    assert _plan_ids(p2) == ["y", "z"]
    assert [(lo.slot, lo.adapter) for lo in p2.slot_loads] == [(1, "b")]
    assert planner.slots.choose_victim() is None  # slot 0 and 1 are referenced (1 is also loading)
    assert [r.request_id for r in planner.waiting] == ["w"]


def test_prefetch_never_evicts_adapters_in_use_or_needed_sooner():
    cfg = _two_slot_overlap_cfg(max_running_requests=1, prefetch_depth=8)
    planner = Planner(cfg)
    for rid, name in [("x", "a"), ("y", "b"), ("z", "c")]:
        planner.add(rid, [1, 2], name, SamplingParams(max_tokens=9))
    p1 = planner.schedule()  # x runs with a's load; b prefetched (max_running_requests stops admission)
    assert _plan_ids(p1) == ["x"]
    assert sorted((lo.slot, lo.adapter) for lo in p1.slot_loads) == [(0, "a"), (1, "b")]
    planner.update(StepResult(step=p1.step, slots_ready=[0, 1]))
    p2 = planner.schedule()
    assert _plan_ids(p2) == [] and not p2.slot_loads  # c: a is in use and b is needed sooner
    assert planner.slots.slot_of("a") == 0 and planner.slots.slot_of("b") == 1


def test_pinned_adapter_is_never_evicted():
    cfg = _two_slot_overlap_cfg(pinned_adapters=("p",), prefetch_depth=4)
    planner = Planner(cfg)
    planner.add("x", [1], "p", SamplingParams(max_tokens=1))
    for i, name in enumerate(["a", "b", "c", "d"]):
        planner.add(f"r{i}", [1], name, SamplingParams(max_tokens=1))
    worker, steps = DelayedReadyWorker(planner, overlap=True), 0
    while planner.has_work:
        steps += 1
        assert steps < 200
        plan = planner.schedule()
        assert all(lo.adapter == "p" or lo.slot != planner.slots.slot_of("p") for lo in plan.slot_loads)
        planner.update(worker.run(plan))
    assert planner.slots.slot_of("p") is not None


def test_loads_under_the_size_threshold_stay_synchronous_and_are_not_prefetched():
    sizes = {"small": 1 << 20, "big": 256 << 20}
    cfg = _two_slot_overlap_cfg(max_running_requests=1, prefetch_depth=4, overlap_min_bytes=64 << 20)
    planner = Planner(cfg, load_bytes=sizes.__getitem__)
    planner.add("s", [1, 2], "small", SamplingParams(max_tokens=3))
    planner.add("b", [1, 2], "big", SamplingParams(max_tokens=3))
    p1 = planner.schedule()
    # the small adapter loads in the very plan that admits its request; the big one is prefetched
    # (overlapped: its slot is marked loading and no request uses it yet)
    assert _plan_ids(p1) == ["s"]
    assert [(lo.slot, lo.adapter) for lo in p1.slot_loads] == [(0, "small"), (1, "big")]
    # only the overlapped copy goes layer by layer (a step may run its first layers early); the small
    # one is a single copy
    assert [lo.layered for lo in p1.slot_loads] == [False, True]
    assert not planner.slots.is_loading(0) and planner.slots.is_loading(1)
    planner.add("s2", [1, 2], "small2", SamplingParams(max_tokens=3))
    sizes["small2"] = 1 << 20
    p2 = planner.schedule()
    assert all(lo.adapter != "small2" for lo in p2.slot_loads), "a cheap adapter was prefetched"
