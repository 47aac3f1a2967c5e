"""Overlapped scheduling at the edges, with hand-written plans run serially and overlapped (each plan
launched before the previous step is finished): a request preempted and resumed in the same plan while
its last token is still on the device, one preempted then resumed later, an abort of a request with a
token in flight, a request finishing while the next step already computes it, and a failing forward
retried adapter group by adapter group with placeholder inputs. Both give the same tokens and results,
and the greedy tokens are those of transformers run on each request alone."""

from __future__ import annotations

import pytest

from proto.base import TokenIds
from proto.plan import BatchPlan, CachedRequestData, NewRequestData
from proto.sampling import SamplingParams
from stages.worker.executor import StepExecutor
from stages.worker.runner import ModelRunner, RunnerConfig
from tests.peft_reference import PeftReference

pytestmark = pytest.mark.timeout(300)

PROMPTS = {"A": [5, 17, 42, 99, 7], "B": [7, 3, 250], "C": [1, 2, 3, 4]}
MAX_TOKENS = {"A": 5, "B": 10, "C": 8}


def _new(rid: str, pages: list[int]) -> NewRequestData:
    p = SamplingParams(max_tokens=MAX_TOKENS[rid], ignore_eos=True)
    return NewRequestData(
        request_id=rid,
        prompt_ids=TokenIds.of(PROMPTS[rid]),
        sampling=p,
        page_ids=pages,
        num_scheduled_tokens=len(PROMPTS[rid]),
    )


def _resume(rid: str, pages: list[int], tokens: int) -> CachedRequestData:
    return CachedRequestData(request_id=rid, new_page_ids=pages, num_scheduled_tokens=tokens, resumed=True)


def _plans(bad_page: int) -> list[BatchPlan]:
    """As a planner with plans in flight sends them: each counts the tokens of the steps before it."""
    return [
        BatchPlan(step=1, new_requests=[_new("A", [0, 1]), _new("B", [2]), _new("C", [3, 4])]),
        BatchPlan(step=2),  # decodes: A, B, C
        # B: preempted and resumed at once, recomputing its 5 tokens (step 2's still on the device);
        # C: aborted with step 2's token in flight
        BatchPlan(
            step=3,
            finished_request_ids=["C"],
            preempted_request_ids=["B"],
            cached_requests=[_resume("B", [5, 6], 5)],
        ),
        BatchPlan(step=4, preempted_request_ids=["A"]),  # A's step-3 token is in flight
        BatchPlan(
            step=5,
            cached_requests=[
                _resume("A", [7, 8, 9], 8),
                CachedRequestData(request_id="B", new_page_ids=[10]),
            ],
        ),
        BatchPlan(step=6),  # A samples its 5th token: it finishes, while step 7 already computes it
        # a new request on a page the cache does not have: the forward fails and runs again per group
        BatchPlan(step=7, new_requests=[_new("C", [bad_page])]),
        BatchPlan(step=8),
        BatchPlan(step=9),
    ]


def _run(runner: ModelRunner, overlap: bool):
    ex = StepExecutor(runner, lambda load: None, max_model_len=64)
    plans = _plans(runner.num_pages + 3)
    outcomes, step = [], None
    for i, plan in enumerate(plans):
        if not overlap:
            outcomes.append(ex.execute(plan))
            continue
        step = step or ex.launch(plan)
        following = ex.launch(plans[i + 1]) if i + 1 < len(plans) else None
        outcomes.append(ex.finish(step))
        step = following
    tokens: dict[str, list[int]] = {}
    for _, batch in outcomes:
        for item in batch.items:
            tokens.setdefault(item.request_id, []).extend(item.token_ids)
    return tokens, [result for result, _ in outcomes], ex


@pytest.fixture(scope="module")
def runs(tiny_llama):
    runner = ModelRunner(RunnerConfig(model_dir=str(tiny_llama), dtype="float32", page_size=4, num_pages=32))
    return _run(runner, overlap=False), _run(runner, overlap=True)


def test_overlapped_equals_serial_at_the_edges(runs):
    (tokens, results, _), (o_tokens, o_results, ex) = runs
    assert o_tokens == tokens
    assert o_results == results
    assert ex.retried_steps == 1 and ex.dropped_rows == 1  # A's step-7 row
    assert [f.request_id for r in results for f in r.finished] == ["A"]
    assert [e.request_id for r in results for e in r.errors] == ["C"]  # the second C, its page is bad
    assert len(tokens["C"]) == 2  # aborted after step 2's token, which was still sent


def test_the_greedy_tokens_are_those_of_each_request_alone(runs, tiny_llama, llama_adapters):
    """Preemption recomputes from a token list that must be complete: placeholders resolved."""
    (tokens, _, _), _ = runs
    ref = PeftReference(tiny_llama, llama_adapters)
    for rid in ("A", "B"):
        ids = list(PROMPTS[rid])
        for _ in tokens[rid]:
            ids.append(int(ref.logits(ids, None)[-1].argmax()))
        assert tokens[rid] == ids[len(PROMPTS[rid]) :], rid
    assert len(tokens["A"]) == MAX_TOKENS["A"] and len(tokens["B"]) == 9
