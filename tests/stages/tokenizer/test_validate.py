"""Request validation: each problem gets its error kind and a message naming it."""

from __future__ import annotations

import pytest

from proto.base import TokenIds
from proto.client import GenerateRequest
from proto.sampling import SamplingParams
from stages.tokenizer.validate import Rejected, validate_generate
from tests.stages.tokenizer.conftest import MAX_MODEL_LEN, VOCAB_SIZE

ADAPTERS = {"a": "registered", "old": "unloading"}


def _check(tokenizer, **kw) -> list[int]:
    req = GenerateRequest(request_id="r", **kw)
    return validate_generate(
        req, tokenizer, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE, adapters=ADAPTERS
    )


def _rejected(tokenizer, kind: str, match: str, **kw) -> None:
    with pytest.raises(Rejected, match=match) as info:
        _check(tokenizer, **kw)
    assert info.value.kind == kind


def test_good_requests(tokenizer):
    assert _check(tokenizer, prompt="hello") == tokenizer.encode("hello").ids
    assert _check(tokenizer, prompt_ids=TokenIds.of([0, 5, 299]), adapter="a") == [0, 5, 299]


def test_rejections(tokenizer):
    _rejected(
        tokenizer, "invalid_request", "temperature", prompt="x", sampling=SamplingParams(temperature=-1)
    )
    _rejected(tokenizer, "invalid_request", "top_p", prompt="x", sampling=SamplingParams(top_p=0))
    _rejected(
        tokenizer,
        "invalid_request",
        "stop_token_ids",
        prompt="x",
        sampling=SamplingParams(stop_token_ids=(300,)),
    )
    _rejected(tokenizer, "unknown_adapter", "unknown adapter 'b'", prompt="x", adapter="b")
    _rejected(tokenizer, "unknown_adapter", "being unloaded", prompt="x", adapter="old")
    _rejected(tokenizer, "invalid_request", "exactly one", prompt="x", prompt_ids=TokenIds.of([1]))
    _rejected(tokenizer, "invalid_request", "exactly one")
    _rejected(tokenizer, "invalid_request", "empty", prompt_ids=TokenIds.of([]))
    _rejected(tokenizer, "invalid_request", "outside the vocabulary", prompt_ids=TokenIds.of([1, 300]))
    _rejected(tokenizer, "invalid_request", "outside the vocabulary", prompt_ids=TokenIds.of([-1]))
    _rejected(tokenizer, "invalid_request", "context of 64", prompt_ids=TokenIds.of([1] * 60))
    _rejected(tokenizer, "invalid_request", "context", prompt="x", sampling=SamplingParams(max_tokens=64))
