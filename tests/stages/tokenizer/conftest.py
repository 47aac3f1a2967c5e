"""A tiny byte-level BPE tokenizer trained on a few lines (multi-byte characters stay split across
tokens) and a model dir holding it with a config.json, for the tokenizer stage's tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEXT = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "héllo wörld, naïve café in the streets",
    "日本語のテキスト and emoji 😀🎉 mixed with ascii",
] * 4
VOCAB_SIZE = 300
MAX_MODEL_LEN = 64


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return make_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    d = tmp_path_factory.mktemp("tokmodel")
    tokenizer.save(str(d / "tokenizer.json"))
    config = {"max_position_embeddings": MAX_MODEL_LEN, "vocab_size": VOCAB_SIZE, "model_type": "llama"}
    (d / "config.json").write_text(json.dumps(config))
    return d
