"""The prefix cache in the planner: chain keys, reference-counted pages with LRU eviction of unreferenced
ones only, the token budget spent on uncached tokens alone, and a randomized run whose page references
match the running requests at every step and all end at zero. A simulated worker (pool_worker.py)
models the KV cache position by position and fails a request that reads KV computed for other tokens
or another adapter, or a step that writes a page another request holds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stages.scheduler.planner as planner_module
from proto.sampling import SamplingParams
from stages.scheduler.page_allocator import PageAllocator
from stages.scheduler.planner import Planner, PlannerConfig
from stages.scheduler.prefix_cache import adapter_key, page_hashes
from tests.stages.scheduler.pool_worker import PLANNER_ALONE, PoolWorker, check_pool

RANKS = {"a": 1, "b": 4, "c": 8}
SAMPLE = SamplingParams(max_tokens=2)


def _planner(generations=None, **kw) -> Planner:
    base = dict(num_pages=64, page_size=4, pool_rows=16, pool_ids=3, max_tokens_per_step=16,
                max_model_len=128, max_lora_rank=8, max_running_requests=8, **PLANNER_ALONE)  # fmt: skip
    gens = generations if generations is not None else {}
    return Planner(
        PlannerConfig(**{**base, **kw}),
        adapter_rows=RANKS.__getitem__,
        adapter_generation=lambda n: gens.get(n, 1),
    )


def _drain(p: Planner, worker: PoolWorker, limit: int = 500) -> list:
    plans = []
    while p.has_work:
        assert len(plans) < limit, "the planner made no progress"
        plans.append(p.schedule())
        p.update(worker.run(plans[-1]))
        _check_refs(p)
    return plans


def _check_refs(p: Planner) -> None:
    """Every page's reference count is the number of running requests holding it."""
    held: dict[int, int] = {}
    for r in p.running:
        for page in r.pages:
            held[page] = held.get(page, 0) + 1
    assert all(p.pages.refs(page) == held.get(page, 0) for page in range(p.cfg.num_pages))
    assert p.pages.num_used == len(held)


def test_chain_keys_follow_adapter_generation_and_every_earlier_token():
    toks = list(range(10, 30))
    a1 = page_hashes(adapter_key("a", 1), toks, 4)
    assert len(a1) == 5 and len(page_hashes(adapter_key("a", 1), toks[:7], 4)) == 1
    assert page_hashes(adapter_key("a", 1), toks[:12] + [0] * 8, 4)[:3] == a1[:3]
    assert page_hashes(adapter_key("a", 1), [9] + toks[1:], 4)[4] != a1[4]  # an earlier token differs
    others = [adapter_key("a", 2), adapter_key("b", 1), adapter_key(None, 0), adapter_key("a1", 1)]
    for root in others:
        assert not set(page_hashes(root, toks, 4)) & set(a1)


def test_only_unreferenced_cached_pages_are_evicted_least_recent_first():
    pages = PageAllocator(6, 4)
    held = pages.allocate(3)
    for i, page in enumerate(held):
        pages.insert(bytes([i]), page, "a")
    pages.free(held[1:])  # held[2] then held[1] become evictable, in that order
    assert pages.num_free == 5 and pages.num_cached == 3
    assert pages.allocate(3) and pages.stats.evictions == 0  # the free pages go first
    (taken,) = pages.allocate(1)
    assert (
        taken == held[2] and pages.stats.evictions == 1 and pages.lookup([bytes([0]), bytes([1])]) == held[:2]
    )
    pages.acquire([held[1]])  # a hit takes it back out of the evictable set
    with pytest.raises(RuntimeError):
        pages.allocate(1)  # held[0] and held[1] are referenced: nothing is left to evict
    assert pages.drop_adapter("a") == 2 and pages.lookup([bytes([0])]) == []
    pages.free([held[0], held[1], taken])  # the three free pages taken first are still held
    assert pages.num_free == 3 and pages.num_cached == 0


def test_budget_counts_only_uncached_tokens_and_prefill_starts_after_the_hit():
    p = _planner()
    worker = PoolWorker(p, RANKS, overlap=False)
    prompt = list(range(40, 62))  # 22 tokens: 5 full pages
    p.add("r0", prompt, "a", SAMPLE)
    _drain(p, worker)
    p.add("r1", prompt + list(range(7, 27)), "a", SAMPLE)  # 42 tokens, 20 cached
    (new,) = p.schedule().new_requests
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (20, 16)  # the budget: uncached only
    plan = p.schedule()
    assert [(c.request_id, c.num_scheduled_tokens) for c in plan.cached_requests] == [("r1", 6)]
    p.abort("r1")
    p.add("r2", prompt[:20], "a", SAMPLE)  # its whole prompt is cached: its last page is computed
    p.add("r3", prompt, "b", SAMPLE)  # the same tokens under another adapter: nothing cached
    p.add("r4", prompt, None, SAMPLE)
    news = {n.request_id: n for n in p.schedule().new_requests}
    assert (news["r2"].num_computed_tokens, news["r2"].num_scheduled_tokens) == (16, 4)
    assert (news["r3"].num_computed_tokens, news["r3"].num_scheduled_tokens) == (0, 12)
    (base,) = [n for n in p.schedule().new_requests if n.request_id == "r4"]  # the base model: nothing
    assert base.num_computed_tokens == 0


def test_a_new_generation_of_the_adapter_finds_nothing():
    gens = {"a": 1}
    p = _planner(gens)
    worker = PoolWorker(p, RANKS, overlap=False)
    prompt = list(range(100, 120))
    p.add("r0", prompt, "a", SAMPLE)
    _drain(p, worker)
    gens["a"] = 2
    p.add("r1", prompt, "a", SAMPLE)
    (new,) = p.schedule().new_requests
    assert new.num_computed_tokens == 0


def test_the_simulated_worker_catches_a_key_without_the_adapter(monkeypatch):
    monkeypatch.setattr(planner_module, "adapter_key", lambda adapter, generation: b"any")
    p = _planner()
    worker = PoolWorker(p, RANKS, overlap=False)
    p.add("r0", list(range(20)), "a", SAMPLE)
    _drain(p, worker)
    p.add("r1", list(range(20)), "b", SAMPLE)
    with pytest.raises(AssertionError, match="reads the wrong KV"):
        _drain(p, worker)


PREFIXES = [list(range(50, 50 + n)) for n in (3, 9, 14)] + [[7] * 12]
REQUEST = st.tuples(
    st.sampled_from([None, *RANKS]),
    st.integers(0, len(PREFIXES) - 1),
    st.lists(st.integers(2, 200), max_size=6),
    st.integers(1, 5),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(REQUEST, min_size=1, max_size=24),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 23)), max_size=4),
    num_pages=st.sampled_from([10, 16, 40]),
    page_size=st.sampled_from([2, 4]),
    budget=st.sampled_from([8, 16, 64]),
    overlap=st.booleans(),
)
def test_random_runs_end_with_every_reference_at_zero(
    requests, aborts, num_pages, page_size, budget, overlap
):
    p = _planner(
        num_pages=num_pages,
        page_size=page_size,
        max_tokens_per_step=budget,
        max_running_requests=4,
        max_model_len=min(40, num_pages * page_size),
        overlap_loading=overlap,
    )
    worker = PoolWorker(p, RANKS, overlap=overlap)
    for i, (adapter, k, suffix, out) in enumerate(requests):
        prompt = (PREFIXES[k] + suffix)[: p.cfg.max_model_len - 1]
        p.add(f"r{i}", prompt, adapter, SamplingParams(max_tokens=out))
    steps = 0
    while p.has_work:
        steps += 1
        assert steps < 2000, "the planner made no progress"
        for at, i in aborts:
            if at == steps:
                p.abort(f"r{i}")
        plan = p.schedule()
        p.update(worker.run(plan))
        check_pool(p)
        _check_refs(p)
    assert all(p.pages.refs(page) == 0 for page in range(num_pages))
    assert p.pages.num_free == num_pages, "KV pages leaked"
    # only unreferenced pages are cached now, and all of them can be taken again
    assert len(p.pages.allocate(num_pages)) == num_pages
