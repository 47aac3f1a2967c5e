"""Planner invariants under random workloads, with a simulated worker holding an independent model of
the GPU adapter pool: KV pages are never over-committed, a step never has more distinct adapters than
`max_loras_per_batch`, a load never takes the rows of an adapter in use, every request finishes, and
nothing leaks (pages, rows, references)."""

from __future__ import annotations

import random

import pytest

from proto.plan import FinishedRequest, StepResult
from proto.sampling import SamplingParams
from stages.scheduler.planner import Planner, PlannerConfig
from tests.stages.scheduler.pool_worker import PLANNER_ALONE, PoolWorker, check_pool

RANKS = {"a": 1, "b": 4, "c": 8, "d": 3, "e": 16}


def _cfg(**kw) -> PlannerConfig:
    base = dict(num_pages=64, page_size=16, pool_rows=16, pool_ids=4, max_tokens_per_step=64,
                max_model_len=256, max_lora_rank=16, **PLANNER_ALONE)  # fmt: skip
    return PlannerConfig(**{**base, **kw})


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_invariants(seed):
    rng = random.Random(seed)
    num_pages, page_size = rng.choice([12, 20, 40]), rng.choice([2, 4, 8])
    cfg = _cfg(
        num_pages=num_pages,
        page_size=page_size,
        pool_rows=rng.choice([16, 20, 33]),
        pool_ids=rng.choice([2, 3, 8]),
        max_loras_per_batch=rng.choice([1, 2, 3]),
        max_running_requests=rng.choice([2, 4, 8]),
        max_tokens_per_step=rng.choice([8, 16, 64]),
        max_model_len=min(64, num_pages * page_size),
    )
    planner = Planner(cfg, adapter_rows=RANKS.__getitem__)
    worker = PoolWorker(planner, RANKS, overlap=False)
    adapters = [None, *RANKS]
    n = 30
    for i in range(n):
        prompt = [1] * rng.randint(1, min(20, cfg.max_model_len - 1))
        planner.add(f"r{i}", prompt, rng.choice(adapters), SamplingParams(max_tokens=rng.randint(1, 12)))
    aborted = set(rng.sample(range(n), 3))
    steps = 0
    while planner.has_work:
        steps += 1
        assert steps < 2000, "planner made no progress"
        if steps == 3:
            for i in aborted:
                planner.abort(f"r{i}")
        plan = planner.schedule()
        planner.update(worker.run(plan))
        check_pool(planner)
    assert planner.pages.num_free == cfg.num_pages, "KV pages leaked"
    assert all(r.refs == 0 for r in planner.pool.residents.values()), "references leaked"
    worker.run(planner.schedule())  # one last plan tells the worker to forget what finished last
    assert not worker.state


def test_decodes_need_no_plan_entries():
    planner = Planner(_cfg(), adapter_rows=RANKS.__getitem__)
    for i in range(8):
        planner.add(f"r{i}", [1, 2, 3], None, SamplingParams(max_tokens=5))
    first = planner.schedule()
    assert len(first.new_requests) == 8
    second = planner.schedule()
    assert not second.new_requests and not second.cached_requests  # 8 plain decodes: an empty diff


def test_adapter_waits_for_rows_while_others_run():
    # 16 rows: c (8) and e (16) cannot both be resident; the base-only request passes
    planner = Planner(_cfg(), adapter_rows=RANKS.__getitem__)
    planner.add("x", [1, 2], "c", SamplingParams(max_tokens=3))
    planner.add("y", [1, 2], "e", SamplingParams(max_tokens=3))
    planner.add("z", [1, 2], None, SamplingParams(max_tokens=3))
    plan = planner.schedule()
    assert [r.request_id for r in plan.new_requests] == ["x", "z"]
    assert [(lo.slot, lo.adapter, lo.row_starts, lo.row_counts) for lo in plan.slot_loads] == [
        (0, "c", [0], [8])
    ]
    done = [FinishedRequest(request_id="x", reason="stop", num_output_tokens=1)]
    planner.update(StepResult(step=plan.step, finished=done))
    plan = planner.schedule()
    assert [r.request_id for r in plan.new_requests] == ["y"]
    assert [(lo.slot, lo.adapter, lo.row_starts, lo.row_counts) for lo in plan.slot_loads] == [
        (0, "e", [0], [16])
    ]
    assert plan.finished_request_ids == ["x"]


def test_small_ranks_share_the_pool():
    """Rank-1, 3, 4 and 8 adapters (16 rows) are resident at once where max-rank slots would hold one."""
    planner = Planner(_cfg(pool_ids=8), adapter_rows=RANKS.__getitem__)
    for name in ("a", "b", "c", "d"):
        planner.add(name, [1, 2], name, SamplingParams(max_tokens=3))
    plan = planner.schedule()
    assert sorted(r.request_id for r in plan.new_requests) == ["a", "b", "c", "d"]
    assert planner.pool.used_rows == 16 and len(planner.pool.residents) == 4


def test_max_loras_per_batch_bounds_distinct_adapters_only():
    planner = Planner(_cfg(max_loras_per_batch=1), adapter_rows=RANKS.__getitem__)
    planner.add("x", [1], "a", SamplingParams(max_tokens=3))
    planner.add("y", [1], "b", SamplingParams(max_tokens=3))
    planner.add("x2", [1], "a", SamplingParams(max_tokens=3))
    planner.add("z", [1], None, SamplingParams(max_tokens=3))
    plan = planner.schedule()
    assert [r.request_id for r in plan.new_requests] == ["x", "x2", "z"]  # b would be a second adapter


def test_rejects_configs_and_prompts_that_cannot_fit():
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        _cfg(num_pages=2, page_size=4, max_model_len=100)
    planner = Planner(_cfg(num_pages=2, page_size=4, max_model_len=8), adapter_rows=RANKS.__getitem__)
    with pytest.raises(ValueError, match="limit is 7"):
        planner.add("big", [1] * 8, None, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        planner.add("empty", [], None, SamplingParams())


def _two_pages(max_running_requests: int = 4) -> PlannerConfig:
    """Two KV pages of 2 tokens: a 2-token prompt growing by one token takes the other request's page."""
    return _cfg(num_pages=2, page_size=2, pool_rows=64, pool_ids=4, max_lora_rank=8, max_tokens_per_step=8,
                max_model_len=4, max_running_requests=max_running_requests)  # fmt: skip


def test_a_request_preempted_by_a_plan_made_before_its_end_finishes_cleanly():
    """With plans in flight, a plan may preempt a request whose last token the worker already sampled;
    its end then arrives while it waits: it leaves the queue and frees nothing twice."""
    cfg = _two_pages()
    p = Planner(cfg, adapter_rows=lambda name: 8)
    p.add("B", [5, 6], None, SamplingParams(max_tokens=2))
    p.add("A", [7], None, SamplingParams(max_tokens=1))
    p.schedule()  # both prefill; A's first token ends it
    assert p.schedule().preempted_request_ids == ["A"]  # planned before that result: B needs A's page
    p.update(
        StepResult(step=1, finished=[FinishedRequest(request_id="A", reason="length", num_output_tokens=1)])
    )
    assert [r.request_id for r in p.waiting] == [] and [r.request_id for r in p.running] == ["B"]
    assert p.schedule().finished_request_ids == ["A"]
    assert p.pages.num_free + len(p.running[0].pages) == cfg.num_pages


def test_queue_waits_count_each_request_once_from_its_arrival():
    """Arrival to first admission, for every request (base-only and adapter ones): a request that waits
    for a running one's KV pages is counted when admitted, and a preempted one is not counted again."""
    now = [0.0]
    cfg = _two_pages(max_running_requests=1)
    p = Planner(cfg, adapter_rows=lambda name: 8, clock=lambda: now[0])
    p.add("A", [5, 6], "a", SamplingParams(max_tokens=2))
    now[0] = 1.0
    p.add("B", [7], None, SamplingParams(max_tokens=1))
    now[0] = 2.5
    plan = p.schedule()  # A runs; B waits (one running request at most)
    assert [r.request_id for r in plan.new_requests] == ["A"] and list(p.queue_waits) == [2.5]
    p.queue_waits.clear()
    now[0] = 4.0
    done = [FinishedRequest(request_id="A", reason="length", num_output_tokens=2)]
    p.update(StepResult(step=plan.step, finished=done))
    plan = p.schedule()
    assert [r.request_id for r in plan.new_requests] == ["B"] and list(p.queue_waits) == [3.0]


def test_a_preempted_request_is_not_counted_again():
    cfg = _two_pages()
    p = Planner(cfg, adapter_rows=lambda name: 8)
    p.add("B", [5, 6], None, SamplingParams(max_tokens=2))
    p.add("A", [7], None, SamplingParams(max_tokens=3))
    p.schedule()
    assert len(p.queue_waits) == 2
    assert p.schedule().preempted_request_ids == ["A"]  # B needs A's page
    done = [FinishedRequest(request_id="B", reason="length", num_output_tokens=2)]
    p.update(StepResult(step=1, finished=done))
    plan = p.schedule()
    assert [r.request_id for r in plan.cached_requests] == ["A"]  # resumed
    assert len(p.queue_waits) == 2
