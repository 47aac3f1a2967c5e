"""Incremental detokenization of one request's output: emits only text that is final, holding back a
multi-byte character whose bytes are split across tokens until they are all there."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"  # what decode() yields for incomplete UTF-8 bytes
CONTEXT_TOKENS = 5  # prompt tokens decoded in front of the output so word-initial spaces come out right


class IncrementalDetokenizer:
    """Keeps a short window of ids: `prefix_offset..read_offset` was emitted already and is decoded
    again as context, `read_offset..` is new. A step emits decode(prefix+new) minus decode(prefix)
    once that no longer ends in U+FFFD (vLLM/TGI's prefix-offset scheme)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def step(self, new_ids: Sequence[int]) -> str:
        """Text made final by `new_ids` ("" while a character is still incomplete)."""
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is held back (incomplete bytes decode as U+FFFD, the
        same as a full decode of the output would show them)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if not final and (len(full) <= len(prefix) or full.endswith(REPLACEMENT)):
            return ""
        delta = full[len(prefix) :]
        # keep only the ids still needed as context: the window stays a few tokens long
        del self.ids[: self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        return delta
