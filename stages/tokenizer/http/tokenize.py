"""vLLM's /tokenize and /detokenize: their request and response bodies, and the work, with the same
checks as generation (the model names the base model or an adapter, a prompt over the byte limit is
refused before it is tokenized, ids must lie in the vocabulary). Adapters share the base tokenizer."""

from __future__ import annotations

from typing import Any

import msgspec

from proto.client import GenerateRequest
from proto.sampling import SamplingParams
from stages.tokenizer.http.errors import ApiError
from stages.tokenizer.http.prepare import Context, render_chat, resolve_model, tokenize_text
from stages.tokenizer.http.schemas import Body, ChatMessage
from stages.tokenizer.validate import Rejected, check_prompt_size


class TokenizeCompletionRequest(Body, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Body, kw_only=True):
    messages: list[ChatMessage]
    model: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes them
    return_token_strs: bool = False


class DetokenizeRequest(Body, kw_only=True):
    tokens: list[int]
    model: str | None = None


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def tokenize_type(raw: dict[str, Any]) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """vLLM's two /tokenize bodies, told apart as vLLM does: by `messages`."""
    return TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest


def _check_model(name: str | None, ctx: Context) -> None:
    adapter = resolve_model(name, ctx) if name is not None else None
    if adapter is not None and ctx.adapters.get(adapter) != "registered":
        raise ApiError(404, f"unknown adapter {adapter!r}; load it first", "model", "model_not_found")


async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, ctx: Context) -> TokenizeResponse:
    _check_model(req.model, ctx)
    if isinstance(req, TokenizeChatRequest):
        text = render_chat(req.messages, req.add_generation_prompt, ctx)
    else:
        text = req.prompt
        probe = GenerateRequest(request_id="", prompt=text, sampling=SamplingParams(max_tokens=1))
        try:
            check_prompt_size(probe, max_prompt_bytes=ctx.max_prompt_bytes, max_model_len=ctx.max_model_len)
        except Rejected as exc:
            raise ApiError(400, exc.message, "prompt") from None
    ids = await tokenize_text(text, ctx.tokenizer, add_special_tokens=req.add_special_tokens)
    strs = [ctx.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(len(ids), ctx.max_model_len, ids, strs)


def detokenize(req: DetokenizeRequest, ctx: Context) -> DetokenizeResponse:
    _check_model(req.model, ctx)
    bad = next((t for t in req.tokens if not 0 <= t < ctx.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
    # special tokens stay in the text, as vLLM's /detokenize returns them
    return DetokenizeResponse(ctx.tokenizer.decode(req.tokens, skip_special_tokens=False))
