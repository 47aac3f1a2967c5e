"""Output tokens' log-probabilities in OpenAI's two shapes: a completion choice's `logprobs` (tokens,
token_logprobs, top_logprobs as {token: logprob}, text_offset) and a chat choice's `logprobs.content`
(token, logprob, bytes, top_logprobs). Each token is named by its own decoded text, as vLLM names it."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from tokenizers import Tokenizer

from proto.client import TokenLogprobs


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class LogprobsFormat:
    """Names tokens with the model's tokenizer (a token's text alone: a piece of a multi-byte character
    reads as U+FFFD, its bytes field says which bytes it stands for only as far as its text does)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def chat(self, ids: Sequence[int], lps: Sequence[TokenLogprobs]) -> ChatLogprobs:
        out = []
        for t, lp in zip(ids, lps, strict=True):
            top = [
                TopLogprob(s := self.text(i), v, list(s.encode()))
                for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ]
            text = self.text(t)
            out.append(ChatTokenLogprob(text, lp.logprob, list(text.encode()), top))
        return ChatLogprobs(out)

    def completion(self, ids: Sequence[int], lps: Sequence[TokenLogprobs], offset: int) -> CompletionLogprobs:
        """`offset`: where the first token's text starts in the choice's text (after any echo)."""
        out = CompletionLogprobs([], [], [], [])
        for t, lp in zip(ids, lps, strict=True):
            text = self.text(t)
            out.text_offset.append(offset)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            top: dict[str, float] = {}  # tokens named alike share the entry of the likeliest
            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
                top.setdefault(self.text(i), v)
            out.top_logprobs.append(top)
            offset += len(text)
        return out
