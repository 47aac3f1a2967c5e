"""A step's grammar job on the masks thread (`GuidedMasks.start` with tokens to feed), against llguidance's
own byte-per-token masks of matchers fed the same tokens: the step thread gets control back before the
step before's tokens are known (the job waits for them itself), verdicts read after it wait for the
feeding, and a failure in the job (the tokens cannot be read, llguidance panics) fails only the
requests it concerns, by name, without hanging the step; a forward run again apart redoes the masks of
the requests it kept."""

from __future__ import annotations

import threading

import llguidance
import pytest
import torch

from proto.sampling import Guided
from runtime.common.grammar import grammar_of, matcher_tokenizer
from stages.worker.guided import GuidedMasks

REGEX = r"[a-c]{2,6}-[0-9]{1,3}"


@pytest.fixture
def setup(tiny_llama):
    vocab, eos = 384, [1]
    tok = matcher_tokenizer((tiny_llama / "tokenizer.json").read_text(), vocab, eos)
    masks = GuidedMasks(str(tiny_llama), vocab, eos, torch.device("cpu"), threads=2)
    yield masks, tok, vocab
    masks.close()


def _reference(tok, tokens: list[int], vocab: int) -> torch.Tensor:
    matcher = llguidance.LLMatcher(tok, grammar_of(Guided("regex", REGEX)))
    for t in tokens:
        assert matcher.consume_token(t), matcher.get_error()
    return torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0


def test_the_job_waits_for_the_step_befores_tokens_itself(setup):
    masks, tok, vocab = setup
    text = tok.tokenize_str("abc-12")
    for rid in ("one", "two"):
        masks.add(rid, Guided("regex", REGEX))
    masks.start(["one", "two"], background=False).wait()  # built
    device_done = threading.Event()  # the step before's tokens reaching the host

    def known() -> list[int]:
        assert device_done.wait(30), "the tokens were never released"
        return [text[1], text[0]]  # rows 0 and 1 of the step before

    # "one" has its first token known and its second a placeholder (row 0); "two" only a placeholder
    job = masks.start(["one", "two"], feed=[("one", [text[0], -1], 0, 2), ("two", [-2], 0, 1)], known=known)
    assert not job.fed.is_set()  # the step thread is back while the job waits for the tokens
    device_done.set()
    assert masks.error("one") is None and masks.error("two") is None  # these wait for the feeding
    got = job.result(vocab)
    assert torch.equal(got[0], _reference(tok, text[:2], vocab))
    assert torch.equal(got[1], _reference(tok, text[:1], vocab))
    # the next step's job: the tokens already taken are not fed again
    job = masks.start(["one"], feed=[("one", text[:3], 0, 3)])
    assert torch.equal(job.result(vocab)[0], _reference(tok, text[:3], vocab))


def test_tokens_that_cannot_be_read_fail_only_the_requests_waiting_for_them(setup):
    masks, tok, vocab = setup
    text = tok.tokenize_str("ab-1")
    for rid in ("late", "ready"):
        masks.add(rid, Guided("regex", REGEX))

    def known() -> list[int]:
        raise RuntimeError("device fault")

    job = masks.start(["late", "ready"], feed=[("late", [-1], 0, 1), ("ready", text[:2], 0, 2)], known=known)
    got = job.result(vocab)
    assert "device fault" in masks.error("late") and job.failed == {0: masks.error("late")}
    assert not got[0].any()  # its row allows nothing: the caller fails the request
    assert masks.error("ready") is None and torch.equal(got[1], _reference(tok, text[:2], vocab))


class _Panic(BaseException):
    """What pyo3 raises for a panic of Rust code (a BaseException, not an Exception)."""


class _PanickingMasks:
    """llguidance's executor, whose mask call panics (its token feeding is the real one)."""

    def __init__(self, inner: llguidance.LLExecutor):
        self.inner = inner

    def consume_token_par(self, pairs):
        return self.inner.consume_token_par(pairs)

    def unsafe_compute_mask_ptr(self, *args):
        raise _Panic("index out of bounds")


def test_a_panic_of_the_mask_call_fails_its_requests_by_name(setup):
    masks, tok, vocab = setup
    masks.add("p", Guided("regex", REGEX))
    masks.start(["p"], background=False).wait()
    real = masks._executor
    masks._executor = _PanickingMasks(real)
    try:
        job = masks.start(["p"], feed=[("p", tok.tokenize_str("ab"), 0, 1)])
        got = job.result(vocab)
    finally:
        masks._executor = real
    assert list(job.failed) == [0] and "llguidance failed: index out of bounds" in job.failed[0]
    assert masks.error("p") == job.failed[0] and not got.any()
    masks.add("q", Guided("regex", REGEX))  # the masks thread and the pool still serve the next step
    assert torch.equal(masks.allowed(["q"], vocab)[0][0], _reference(tok, [], vocab))


def _run_steps(runner, new: list[tuple[str, list[int]]], steps: int):
    """Serial steps of an executor: step 1 admits `new` (request id, its pages), the rest decode."""
    from proto.base import TokenIds
    from proto.plan import BatchPlan, NewRequestData
    from proto.sampling import SamplingParams
    from stages.worker.executor import StepExecutor

    ex = StepExecutor(runner, lambda load: None, max_model_len=64)
    params = SamplingParams(max_tokens=8, guided=Guided("regex", REGEX))
    admitted = [
        NewRequestData(
            request_id=rid,
            prompt_ids=TokenIds.of([5, 17, 42]),
            sampling=params,
            page_ids=pages,
            num_scheduled_tokens=3,
        )  # fmt: skip
        for rid, pages in new
    ]
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for step in range(1, steps + 1):
        result, batch = ex.execute(BatchPlan(step=step, new_requests=admitted if step == 1 else []))
        errors |= {e.request_id: e.message for e in result.errors}
        for item in batch.items:
            tokens.setdefault(item.request_id, []).extend(item.token_ids)
    ex.guided.close()
    return tokens, errors


def test_a_forward_run_again_apart_masks_the_requests_it_kept(tiny_llama):
    """A step whose forward fails runs again request by request and drops the one that fails again: the
    grammar job started before the forward is redone for the requests kept, whose output is what it is
    when that request runs alone."""
    from stages.worker.runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(model_dir=str(tiny_llama), dtype="float32", page_size=4, num_pages=32))
    alone, _ = _run_steps(runner, [("G1", [0, 1, 2])], 6)
    kept, errors = _run_steps(runner, [("G1", [0, 1, 2]), ("G2", [runner.num_pages + 3])], 6)
    assert list(errors) == ["G2"] and "worker step failed" in errors["G2"]
    assert kept["G1"] == alone["G1"] and len(alone["G1"]) >= 2
    tok = matcher_tokenizer((tiny_llama / "tokenizer.json").read_text(), 384, [1])
    matcher = llguidance.LLMatcher(tok, grammar_of(Guided("regex", REGEX)))
    assert all(matcher.consume_token(t) for t in kept["G1"] if t != 1), matcher.get_error()
