"""The worker's grammar masks against llguidance's own byte-per-token masks of matchers fed the same tokens
one by one: requests that share a grammar advance apart (each a copy of one compiled matcher), a step's
new tokens go in one call (one or several a request), masks computed in the background equal those
computed at once, the unpacked rows cover a width past the vocabulary (padded, nothing allowed there),
a token outside the grammar fails its request alone, with the reason, and requests of one grammar spread
over several templates keep their own rows."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from proto.sampling import Guided
from runtime.common.grammar import grammar_of, matcher_tokenizer
from stages.worker import guided as guided_module
from stages.worker.guided import GuidedMasks

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,6}-[0-9]{1,3}"


@pytest.fixture(scope="module")
def setup(tiny_llama):
    """A GuidedMasks over the tiny model's tokenizer (vocab 384, masks 12 words, width 400 > vocab) and
    the same tokenizer for the reference matchers."""
    vocab, eos = 384, [1]
    tok = matcher_tokenizer((tiny_llama / "tokenizer.json").read_text(), vocab, eos)
    masks = GuidedMasks(str(tiny_llama), vocab, eos, torch.device("cpu"))
    yield masks, tok, vocab
    masks.close()


def _reference(tok, guided: Guided, tokens: list[int], width: int) -> torch.Tensor:
    """llguidance's mask after `tokens`, one byte a token, padded with False to `width`."""
    matcher = llguidance.LLMatcher(tok, grammar_of(guided))
    for t in tokens:
        assert matcher.consume_token(t), matcher.get_error()
    row = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) > 0
    return torch.cat((row, torch.zeros(width - row.shape[0], dtype=torch.bool)))


def _encode(tok, text: str) -> list[int]:
    return tok.tokenize_str(text)


@pytest.mark.parametrize("background", [False, True])
def test_masks_follow_each_requests_own_tokens(setup, background):
    masks, tok, vocab = setup
    width = vocab + 16
    js, rx = Guided("json", json.dumps(SCHEMA)), Guided("regex", REGEX)
    # r1 and r2 share a grammar: r2 must not see r1's tokens
    plan = {
        "r1": (js, _encode(tok, '{"answer":"yes","n":4')),
        "r2": (js, []),
        "r3": (rx, _encode(tok, "ab-1")),
    }
    for rid, (g, _) in plan.items():
        masks.add(f"{rid}{background}", g)
    ids = [f"{rid}{background}" for rid in plan]
    fed = {rid: 0 for rid in plan}
    while any(fed[rid] < len(toks) for rid, (_, toks) in plan.items()):
        # one token a request this step, two for r1 while it can: several at once go apart
        step = []
        for rid, (_, toks) in plan.items():
            fed[rid] = min(len(toks), fed[rid] + (2 if rid == "r1" else 1))
            step.append((f"{rid}{background}", toks, 0, fed[rid]))
        masks.feed(step)
        assert all(masks.error(rid) is None for rid in ids)
        job = masks.start(ids, background=background)
        got = job.result(width)
        assert job.failed == {}
        for j, (rid, (g, toks)) in enumerate(plan.items()):
            assert torch.equal(got[j], _reference(tok, g, toks[: fed[rid]], width)), rid
    assert not masks.stopped("r1" + str(background))  # the object is not closed yet


def test_a_token_outside_the_grammar_fails_its_request_alone(setup):
    masks, tok, vocab = setup
    g = Guided("regex", REGEX)
    masks.add("bad", g)
    masks.add("good", g)
    masks.add("done", Guided("choice", json.dumps(["ab"])))
    fed = {"bad": _encode(tok, "9"), "good": _encode(tok, "a"), "done": _encode(tok, "ab")}
    masks.feed([(rid, toks, 0, len(toks)) for rid, toks in fed.items()])
    assert masks.error("bad") is not None and "left its grammar" in masks.error("bad")
    assert masks.error("good") is None and not masks.stopped("good")
    assert masks.stopped("done")  # the choice is complete: its request ends
    allowed, failed = masks.allowed(["bad", "good"], vocab)
    assert list(failed) == [0] and failed[0] == masks.error("bad")
    assert not allowed[0].any()  # the failed row allows nothing
    assert torch.equal(allowed[1], _reference(tok, g, _encode(tok, "a"), vocab))
    masks.feed([("bad", fed["bad"] + _encode(tok, "a"), 0, 2)])  # nothing more is fed to a failed matcher
    assert "left its grammar" in masks.error("bad")


def test_placeholders_are_the_step_befores_tokens(setup):
    """A token still on the device is a placeholder -1 - row, read from `known()` (the step before's
    tokens) only when one is met; one new token or several, the matcher takes the real ids."""
    masks, tok, vocab = setup
    g = Guided("regex", REGEX)
    text = _encode(tok, "abc-12")
    masks.add("one", g)
    masks.add("two", g)
    reads = []

    def known() -> list[int]:
        reads.append(1)
        return [text[3], text[1]]  # rows 0 and 1 of the step before

    masks.feed([("one", text[:3] + [-1], 0, 4), ("two", [text[0], -2], 0, 2)], known)
    assert reads and masks.error("one") is None and masks.error("two") is None
    allowed, _ = masks.allowed(["one", "two"], vocab)
    assert torch.equal(allowed[0], _reference(tok, g, text[:4], vocab))
    assert torch.equal(allowed[1], _reference(tok, g, text[:2], vocab))
    reads.clear()
    masks.feed([("one", text[:5], 0, 5)], known)  # no placeholder: the step before's tokens are not read
    assert not reads and torch.equal(masks.allowed(["one"], vocab)[0][0], _reference(tok, g, text[:5], vocab))


def test_a_grammar_spread_over_templates_keeps_each_requests_rows(tiny_llama, monkeypatch):
    """Requests of one grammar copy several templates in turn (copies of one share a lexer lock); the
    pool is handed each template's copies together, in another order than the step's rows: every mask
    still lands in its own request's row, and a token that breaks a grammar fails that request alone."""
    monkeypatch.setattr(guided_module, "TEMPLATES_BUDGET_S", 1e3)  # as many templates as asked, however slow
    vocab, eos = 384, [1]
    tok = matcher_tokenizer((tiny_llama / "tokenizer.json").read_text(), vocab, eos)
    masks = GuidedMasks(str(tiny_llama), vocab, eos, torch.device("cpu"), threads=2, templates=3)
    g = Guided("regex", REGEX)
    texts = ["ab-1", "c", "abc-", "ba-99", "a", "cc-7"]
    ids = [f"t{i}" for i in range(len(texts))]
    for rid in ids:
        masks.add(rid, g)
    masks.start(ids, background=False).wait()  # built
    assert [masks._requests[rid].slot for rid in ids] == [0, 1, 2, 0, 1, 2]
    streams = {rid: _encode(tok, text) for rid, text in zip(ids, texts, strict=True)}
    streams["t4"] = streams["t4"] + _encode(tok, "9")  # "a9" leaves the grammar
    width = vocab + 16
    for n in range(1, max(map(len, streams.values())) + 1):
        masks.feed([(rid, toks, 0, min(n, len(toks))) for rid, toks in streams.items()])
        live = [rid for rid in reversed(ids) if masks.error(rid) is None]
        job = masks.start(live, background=True)
        got = job.result(width)
        assert job.failed == {}
        for j, rid in enumerate(live):
            assert torch.equal(got[j], _reference(tok, g, streams[rid][:n], width)), (rid, n)
    assert [rid for rid in ids if masks.error(rid) is not None] == ["t4"]
    assert masks.seconds["feed"] > 0 and masks.seconds["start"] > 0 and masks.seconds["wait"] > 0
    masks.close()


def test_a_grammar_slow_to_compile_keeps_one_template(tiny_llama, monkeypatch):
    """Past the compile budget a grammar gets no further templates: every request copies the first."""
    monkeypatch.setattr(guided_module, "TEMPLATES_BUDGET_S", 0.0)
    vocab, eos = 384, [1]
    masks = GuidedMasks(str(tiny_llama), vocab, eos, torch.device("cpu"), threads=2, templates=3)
    ids = [f"s{i}" for i in range(4)]
    for rid in ids:
        masks.add(rid, Guided("regex", REGEX))
    masks.start(ids, background=False).wait()
    assert [masks._requests[rid].slot for rid in ids] == [0, 0, 0, 0]
    masks.close()
