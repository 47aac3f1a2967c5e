"""Which prompt positions a step reports prompt_logprobs for: each position whose logits predict a prompt
token, once, across prefill chunks and a recompute after preemption; none for requests that do not ask."""

from __future__ import annotations

from proto.sampling import SamplingParams
from stages.worker.prompt_logprobs import prompt_wants
from stages.worker.step_state import WorkerRequest


def _req(prompt_len: int, asks: bool) -> WorkerRequest:
    p = SamplingParams(prompt_logprobs=2 if asks else None)
    return WorkerRequest("r", list(range(prompt_len)), prompt_len, p, slot=-1, pages=[])


def _covered(req: WorkerRequest, chunks: list[int]) -> list[int]:
    """The prompt positions reported over these chunk sizes (the executor's bookkeeping, by hand)."""
    seen: list[int] = []
    for n in chunks:
        wants = prompt_wants([(req, n)])
        if wants:
            first, count = wants[0]
            start = req.num_computed + first
            seen.extend(range(start, start + count))
            req.prompt_lp_done = start + count
        req.num_computed += n
    return seen


def test_each_prompt_position_once_across_chunks_and_a_recompute():
    req = _req(10, asks=True)
    assert _covered(req, [4, 4]) == list(range(8))
    req.num_computed = 0  # preempted: the prefill is computed again, in other chunks
    assert _covered(req, [3, 5]) == []
    assert _covered(req, [2]) == [8]  # the last prompt position predicts an output token, not reported
    assert _covered(req, [1]) == []


def test_requests_that_do_not_ask_get_nothing():
    assert prompt_wants([(_req(10, asks=False), 10)]) == {}
    assert prompt_wants([(_req(1, asks=True), 1)]) == {}  # one prompt token: nothing predicts it
