"""Planner invariants with overlapped loading and prefetch under pool pressure, against a simulated
worker with an independent model of the pool that reports an overlapped load ready one step later: a
load never takes rows an adapter in use holds, a request runs only on an id whose rows hold its adapter
(possibly still in flight: the worker gates each layer on its copy), a step never has more distinct
adapters than `max_loras_per_batch`, pinned adapters stay resident, and everything finishes without
leaks."""

from __future__ import annotations

import random

import pytest

from proto.plan import StepResult
from proto.sampling import SamplingParams
from stages.scheduler.planner import Planner, PlannerConfig
from tests.stages.scheduler.pool_worker import PLANNER_ALONE, PoolWorker, check_pool

pytestmark = pytest.mark.timeout(60)

RANKS = {f"a{i}": (1, 3, 4, 8)[i % 4] for i in range(12)} | {"a": 8, "b": 8, "c": 8, "p": 8}


def _drive(cfg: PlannerConfig, rng: random.Random, adapters: list, n: int) -> Planner:
    planner = Planner(cfg, adapter_rows=RANKS.__getitem__)
    worker = PoolWorker(planner, RANKS, cfg.overlap_loading)
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
        planner.update(worker.run(plan))
        check_pool(planner)
    assert planner.pages.num_free == cfg.num_pages, "KV pages leaked"
    assert all(r.refs == 0 for r in planner.pool.residents.values()), "references leaked"
    return planner


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("overlap,depth", [(True, 0), (True, 8), (False, 8), (True, 2)])
def test_pool_pressure_keeps_invariants(seed, overlap, depth):
    rng = random.Random(seed)
    pool_rows = rng.choice([8, 12, 17])
    num_pages, page_size = rng.choice([16, 40]), rng.choice([2, 4])
    cfg = PlannerConfig(
        num_pages=num_pages,
        page_size=page_size,
        pool_rows=pool_rows,
        pool_ids=rng.choice([2, 4, 16]),
        max_loras_per_batch=rng.choice([1, 2, 3, 16]),
        max_running_requests=rng.choice([2, 4, 8]),
        max_tokens_per_step=rng.choice([8, 16, 64]),
        max_model_len=min(48, num_pages * page_size),
        pinned_adapters=("a0",) if seed % 2 else (),
        **{**PLANNER_ALONE, "overlap_loading": overlap, "prefetch_depth": depth},
        max_adapter_bypass=rng.choice([1, 4, 16]),
        max_lora_rank=8,
    )
    adapters = [None] + [f"a{i}" for i in range(12)]  # ~10x more adapter rows than the pool holds
    planner = _drive(cfg, rng, adapters, 40)
    assert planner.stats.adapter_loads > 0


def _overlap_cfg(**changes) -> PlannerConfig:
    """Room for two rank-8 adapters, overlap on, room for every request of the small scenarios below."""
    base = dict(num_pages=64, page_size=16, pool_rows=16, pool_ids=4, max_tokens_per_step=64,
                max_model_len=256, max_lora_rank=8, **{**PLANNER_ALONE, "overlap_loading": True})  # fmt: skip
    return PlannerConfig(**{**base, **changes})


def _plan_ids(plan):
    return [r.request_id for r in plan.new_requests]


def _loads(plan):
    return [(lo.slot, lo.adapter, lo.row_starts) for lo in plan.slot_loads]


def test_overlap_admits_requests_in_the_step_of_their_load():
    """A request whose adapter must be loaded runs in the very plan that issues the load (the worker
    gates each layer on its copy); the adapter stays loading, so no victim choice touches it, until the
    worker reports it ready, while resident and base-only requests run beside it."""
    planner = Planner(_overlap_cfg(), adapter_rows=RANKS.__getitem__)
    planner.add("x", [1, 2], "a", SamplingParams(max_tokens=9))
    p1 = planner.schedule()
    assert _plan_ids(p1) == ["x"] and _loads(p1) == [(0, "a", [0])]
    assert planner.pool.get("a").loading and planner.pool.get("a").refs == 1
    planner.update(StepResult(step=p1.step, slots_ready=[0]))
    assert not planner.pool.get("a").loading
    planner.add("y", [1, 2], "b", SamplingParams(max_tokens=9))
    planner.add("z", [1, 2], None, SamplingParams(max_tokens=9))
    planner.add("w", [1, 2], "c", SamplingParams(max_tokens=9))
    p2 = planner.schedule()
    # x decodes on its resident adapter, y joins with b's load, z is base-only; c has no rows to go to
    assert _plan_ids(p2) == ["y", "z"]
    assert _loads(p2) == [(1, "b", [8])]
    assert planner.pool.victims(8) is None  # a and b are referenced (b is also loading)
    assert [r.request_id for r in planner.waiting] == ["w"]


def test_prefetch_never_evicts_adapters_in_use_or_needed_sooner():
    planner = Planner(_overlap_cfg(max_running_requests=1, prefetch_depth=8), adapter_rows=RANKS.__getitem__)
    for rid, name in [("x", "a"), ("y", "b"), ("z", "c")]:
        planner.add(rid, [1, 2], name, SamplingParams(max_tokens=9))
    p1 = planner.schedule()  # x runs with a's load; b prefetched (max_running_requests stops admission)
    assert _plan_ids(p1) == ["x"]
    assert sorted(_loads(p1)) == [(0, "a", [0]), (1, "b", [8])]
    planner.update(StepResult(step=p1.step, slots_ready=[0, 1]))
    p2 = planner.schedule()
    assert _plan_ids(p2) == [] and not p2.slot_loads  # c: a is in use and b is needed sooner
    assert planner.pool.id_of("a") == 0 and planner.pool.id_of("b") == 1


def test_pinned_adapter_is_never_evicted():
    planner = Planner(
        _overlap_cfg(pool_rows=24, pinned_adapters=("p",), prefetch_depth=4), adapter_rows=RANKS.__getitem__
    )
    planner.add("x", [1], "p", SamplingParams(max_tokens=1))
    for i, name in enumerate(["a", "b", "c", "a1", "a2"]):
        planner.add(f"r{i}", [1], name, SamplingParams(max_tokens=1))
    worker, steps = PoolWorker(planner, RANKS, overlap=True), 0
    while planner.has_work:
        steps += 1
        assert steps < 200
        planner.update(worker.run(planner.schedule()))
    assert planner.pool.get("p") is not None and planner.pool.get("p").pinned and worker.pinned == {"p"}


def test_loads_under_the_size_threshold_stay_synchronous_and_are_not_prefetched():
    sizes = {"a": 1 << 20, "b": 256 << 20}
    cfg = _overlap_cfg(max_running_requests=1, prefetch_depth=4, overlap_min_mb=64.0)
    planner = Planner(cfg, adapter_rows=RANKS.__getitem__, load_bytes=sizes.__getitem__)
    planner.add("s", [1, 2], "a", SamplingParams(max_tokens=3))
    planner.add("b", [1, 2], "b", SamplingParams(max_tokens=3))
    p1 = planner.schedule()
    # the small adapter loads in the very plan that admits its request; the big one is prefetched
    # (overlapped: marked loading and no request uses it yet)
    assert _plan_ids(p1) == ["s"]
    assert _loads(p1) == [(0, "a", [0]), (1, "b", [8])]
    # only the overlapped copy goes layer by layer (a step may run its first layers early); the small
    # one is a single copy
    assert [lo.layered for lo in p1.slot_loads] == [False, True]
    assert not planner.pool.get("a").loading and planner.pool.get("b").loading
    planner.add("s2", [1, 2], "c", SamplingParams(max_tokens=3))
    sizes["c"] = 1 << 20
    p2 = planner.schedule()
    assert all(lo.adapter != "c" for lo in p2.slot_loads), "a cheap adapter was prefetched"
