"""A tokenizer llguidance cannot hold (a token of more than 1,024 bytes makes its Rust code panic, which
pyo3 raises as a BaseException): building it raises ValueError by name, and on the worker only the
request that asked for structured output fails, with that reason, instead of the step (and the stage)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from proto.sampling import Guided
from runtime.common.grammar import matcher_tokenizer
from stages.worker.guided import GuidedMasks


def _spaces_tokenizer(longest: int) -> str:
    """A byte-level BPE whose tokens are runs of 1..`longest` spaces, plus an EOS (id 0)."""
    vocab = {"<eos>": 0, "Ġ": 1} | {"Ġ" * k: k for k in range(2, longest + 1)}
    merges = [("Ġ" * (k - 1), "Ġ") for k in range(2, longest + 1)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return tok.to_str()


def test_a_tokenizer_llguidance_cannot_hold_is_refused_by_name():
    assert matcher_tokenizer(_spaces_tokenizer(1024), 1025, [0]) is not None  # at the limit: fine
    with pytest.raises(ValueError, match="llguidance failed: .*num_parents"):
        matcher_tokenizer(_spaces_tokenizer(1025), 1026, [0])


def test_only_the_guided_request_fails_on_such_a_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text(_spaces_tokenizer(1100))
    masks = GuidedMasks(str(tmp_path), 1101, [0], torch.device("cpu"))
    try:
        masks.add("r1", Guided("json", json.dumps({"type": "object"})))
        allowed, failed = masks.allowed(["r1"], 1101)
        assert list(failed) == [0]
        assert "could not be built" in failed[0] and "llguidance failed" in failed[0]
        assert not allowed.any()  # its row allows nothing: the caller fails the request
        assert masks.advance("r1", [5]) == failed[0]  # the reason stays
    finally:
        masks.close()
