"""Tokenizer stage: client connections, validation, text ↔ ids, incremental detokenization, streaming."""

from stages.tokenizer.actor import TokenizerActor
from stages.tokenizer.config import TokenizerConfig
from stages.tokenizer.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer", "TokenizerActor", "TokenizerConfig"]
