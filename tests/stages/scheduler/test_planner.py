"""Planner invariants under random workloads, with a simulated worker: KV pages are never
over-committed, a step never needs more adapters than slots, a referenced slot is never evicted,
every request finishes, and nothing leaks."""

from __future__ import annotations

import random

import pytest

from proto.plan import FinishedRequest, StepResult
from proto.sampling import SamplingParams
from stages.scheduler.planner import Planner, PlannerConfig


class FakeWorker:
    """Tracks what the worker would: tokens per request; finishes after max_tokens outputs."""

    def __init__(self):
        self.state: dict[str, dict] = {}

    def run(self, plan, planner: Planner) -> StepResult:
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        for rid in plan.preempted_request_ids:
            self.state[rid].update(computed=0, active=False, pages=[])
        counts = {}
        for n in plan.new_requests:
            prompt = n.prompt_ids.tolist()
            self.state[n.request_id] = dict(
                tokens=len(prompt),
                prompt=len(prompt),
                computed=0,
                active=True,
                pages=list(n.page_ids),
                max_tokens=n.sampling.max_tokens,
                slot=n.slot,
            )
            counts[n.request_id] = n.num_scheduled_tokens
        for c in plan.cached_requests:
            st = self.state[c.request_id]
            if c.resumed:
                st.update(active=True, pages=list(c.new_page_ids), slot=c.slot)
            else:
                st["pages"] += c.new_page_ids
            counts[c.request_id] = c.num_scheduled_tokens
        finished = []
        slots_in_step = set()
        for rid, st in self.state.items():
            if not st["active"]:
                continue
            n = counts.get(rid, 1)
            st["computed"] += n
            assert st["computed"] <= st["tokens"], f"{rid} computes tokens it does not have"
            need = -(-st["computed"] // planner.cfg.page_size)
            assert len(st["pages"]) >= need, f"{rid} has {len(st['pages'])} pages for {st['computed']} tokens"
            if st["slot"] >= 0:
                slots_in_step.add(st["slot"])
                assert planner.slots.slots[st["slot"]].refs > 0, "a step uses an unreferenced slot"
            if st["computed"] == st["tokens"]:
                st["tokens"] += 1
                if (
                    st["tokens"] - st["prompt"] >= st["max_tokens"]
                    or st["tokens"] >= planner.cfg.max_model_len
                ):
                    st["active"] = False
                    finished.append(FinishedRequest(request_id=rid, reason="length", num_output_tokens=0))
        assert len(slots_in_step) <= planner.cfg.num_slots
        all_pages = [p for st in self.state.values() if st["active"] for p in st["pages"]]
        assert len(all_pages) == len(set(all_pages)), "a KV page is shared by two running requests"
        return StepResult(step=plan.step, finished=finished)


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_invariants(seed):
    rng = random.Random(seed)
    num_pages, page_size = rng.choice([12, 20, 40]), rng.choice([2, 4, 8])
    cfg = PlannerConfig(
        num_slots=rng.choice([1, 2, 3]),
        num_pages=num_pages,
        page_size=page_size,
        max_running_requests=rng.choice([2, 4, 8]),
        max_tokens_per_step=rng.choice([8, 16, 64]),
        max_model_len=min(64, num_pages * page_size),
    )
    planner, worker = Planner(cfg), FakeWorker()
    adapters = [None, "a", "b", "c", "d", "e"]
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
        planner.update(worker.run(plan, planner))
        for i, s in enumerate(planner.slots.slots):
            users = sum(1 for r in planner.running if r.slot == i)
            assert s.refs == users, f"slot {i} refcount {s.refs} != {users} running users"
    assert planner.pages.num_free == cfg.num_pages, "KV pages leaked"
    assert all(s.refs == 0 for s in planner.slots.slots), "slot references leaked"
    # one last plan tells the worker to forget what finished last
    worker.run(planner.schedule(), planner)
    assert not worker.state


def test_decodes_need_no_plan_entries():
    planner = Planner(
        PlannerConfig(num_slots=1, num_pages=64, page_size=16, max_tokens_per_step=64, max_model_len=256)
    )
    for i in range(8):
        planner.add(f"r{i}", [1, 2, 3], None, SamplingParams(max_tokens=5))
    first = planner.schedule()
    assert len(first.new_requests) == 8
    second = planner.schedule()
    assert not second.new_requests and not second.cached_requests  # 8 plain decodes: an empty diff


def test_adapter_waits_for_a_free_slot_while_others_run():
    planner = Planner(
        PlannerConfig(num_slots=1, num_pages=64, page_size=16, max_tokens_per_step=64, max_model_len=256)
    )
    planner.add("x", [1, 2], "a", SamplingParams(max_tokens=3))
    planner.add("y", [1, 2], "b", SamplingParams(max_tokens=3))
    planner.add("z", [1, 2], None, SamplingParams(max_tokens=3))
    plan = planner.schedule()
    assert [r.request_id for r in plan.new_requests] == ["x", "z"]
    assert [(lo.slot, lo.adapter) for lo in plan.slot_loads] == [(0, "a")]
    planner.update(
        StepResult(
            step=plan.step, finished=[FinishedRequest(request_id="x", reason="stop", num_output_tokens=1)]
        )
    )
    plan = planner.schedule()
    assert [r.request_id for r in plan.new_requests] == ["y"]
    assert [(lo.slot, lo.adapter) for lo in plan.slot_loads] == [(0, "b")]
    assert plan.finished_request_ids == ["x"]


def test_rejects_configs_and_prompts_that_cannot_fit():
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        PlannerConfig(num_slots=1, num_pages=2, page_size=4, max_tokens_per_step=64, max_model_len=100)
    planner = Planner(
        PlannerConfig(num_slots=1, num_pages=2, page_size=4, max_tokens_per_step=64, max_model_len=8)
    )
    with pytest.raises(ValueError, match="limit is 7"):
        planner.add("big", [1] * 8, None, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        planner.add("empty", [], None, SamplingParams())
