"""OpenAI request bodies → validated GenerateRequests, one per choice (prompt × n): model name to adapter,
sampling fields to SamplingParams, prompts tokenized and checked with the tokenizer's own validate.py,
so a bad request gets its 400/404 before any response starts."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from tokenizers import Tokenizer

from proto.base import TokenIds
from proto.client import GenerateRequest
from proto.sampling import MAX_LOGPROBS, SamplingParams
from stages.tokenizer.http.chat_template import ChatTemplate, TemplateError
from stages.tokenizer.http.errors import ApiError
from stages.tokenizer.http.schemas import ChatCompletionRequest, CompletionRequest
from stages.tokenizer.http.strict import unsupported_field
from stages.tokenizer.http.structured import guided_of
from stages.tokenizer.validate import (
    Rejected,
    check_prompt,
    check_prompt_size,
    check_request,
    encode_prompt,
)

MAX_CHOICES = 256  # prompts × n in one HTTP request
THREAD_TOKENIZE_CHARS = 8192  # longer texts are tokenized in a thread (tokenizers drops the GIL)
_FIELDS = set(SamplingParams.__struct_fields__) | {"n", "prompt", "stop", "messages"}


@dataclass(frozen=True)
class Context:
    """What the tokenizer stage knows that a request is checked against."""

    tokenizer: Tokenizer
    model_name: str  # the base model's served name
    max_model_len: int
    vocab_size: int
    adapters: Mapping[str, str]  # name -> "registered" | "unloading"
    chat_template: ChatTemplate
    max_prompt_bytes: int  # the actor's limit (validate.prompt_byte_limit): text over it is not tokenized


@dataclass
class Prepared:
    requests: list[GenerateRequest]  # one per choice, prompt_ids set, streaming
    prompt_tokens: list[int]  # per choice
    echo: list[str] = field(default_factory=list)  # per choice: text put in front of its output
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    distinct_prompt_tokens: int = 0  # usage counts each prompt once, however many choices share it
    token_ids: bool = False  # return_token_ids: choices carry their output token ids
    logprobs: bool = False  # choices carry their tokens' log-probabilities


def resolve_model(name: str, ctx: Context) -> str | None:
    """The adapter a `model` names (None: the base model): an adapter's name, the base model's name, or
    `base:adapter`. Unknown names are a 404 naming what is served."""
    base, sep, adapter = name.partition(":")
    if sep:
        if base != ctx.model_name:
            raise ApiError(
                404, f"model {name!r}: the base model is {ctx.model_name!r}", "model", "model_not_found"
            )
        return adapter  # an unknown adapter is reported by check_request
    if name == ctx.model_name:
        return None
    if name in ctx.adapters:
        return name
    raise ApiError(
        404,
        f"model {name!r} does not exist: this server serves {ctx.model_name!r} and its adapters "
        "(GET /v1/models lists them)",
        "model",
        "model_not_found",
    )


def _rejected(exc: Rejected) -> ApiError:
    first = exc.message.split(" ", 1)[0]
    return ApiError.of_kind(exc.kind, exc.message, first if first in _FIELDS else None)


def _check_fields(req: CompletionRequest | ChatCompletionRequest) -> None:
    """What strict.py cannot see alone: n and best_of (one sample per choice), logprobs of output
    tokens only (not echo's prompt), top_logprobs with logprobs."""
    if req.best_of is not None and req.best_of != req.n:
        message = "best_of must equal n (one sample per choice)"
        raise ApiError(400, message, "best_of", "unsupported_parameter")
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        raise ApiError(
            400, "echo with logprobs needs the prompt's log-probabilities, which this server does not "
            "compute", "echo", "unsupported_parameter",
        )  # fmt: skip
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None:
        if not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    if isinstance(req, CompletionRequest) and req.prompt_logprobs is not None and req.stream:
        message = "prompt_logprobs are not available when stream is true (as in vLLM)"
        raise ApiError(400, message, "prompt_logprobs", "unsupported_parameter")
    if not 1 <= req.n <= MAX_CHOICES:
        raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {req.n}", "n")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", "stop")
    return stops


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, index: int) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None else 0
    guided = guided_of(req)  # checked once: grammar_error caches its verdict
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if top_k == -1 else top_k,
        seed=None if req.seed is None else req.seed + index,  # choices differ, and each is reproducible
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        min_p=float(req.min_p or 0.0),
        logit_bias=_logit_bias(req.logit_bias),
        logprobs=_logprobs(req),
        guided=guided,
        prompt_logprobs=getattr(req, "prompt_logprobs", None),
    )


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many likeliest tokens to report beside each output token's own (None: no logprobs)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias names tokens by their ids written as strings."""
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        message = "logit_bias keys must be token ids (integers written as strings)"
        raise ApiError(400, message, "logit_bias") from None


async def tokenize_text(text: str, tokenizer: Tokenizer, *, add_special_tokens: bool) -> list[int]:
    """Long texts in a thread (tokenizers drops the GIL), so other requests are not held up. A rendered
    chat adds no special tokens: they come from the template (as in HF)."""
    if len(text) > THREAD_TOKENIZE_CHARS:
        return (await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)).ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The completion prompts: a string, a list of strings, token ids, or a list of token-id lists."""

    def ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and ids(prompt):
        return [prompt]
    if prompt and all(ids(p) for p in prompt):
        return list(prompt)
    raise ApiError(
        400,
        "prompt must be a non-empty string, list of strings, token ids or list of token-id lists",
        "prompt",
    )


def _generate(rid: str, adapter: str | None, sampling: SamplingParams, ids: Sequence[int]) -> GenerateRequest:
    try:
        prompt_ids = TokenIds.of(ids)
    except (TypeError, OverflowError, ValueError) as exc:
        raise ApiError(400, f"prompt token ids must be int32 integers: {exc}", "prompt") from None
    return GenerateRequest(request_id=rid, prompt_ids=prompt_ids, adapter=adapter, sampling=sampling)


async def prepare_completion(req: CompletionRequest, ctx: Context) -> Prepared:
    _check_fields(req)
    adapter = resolve_model(req.model, ctx)
    prompts = _prompts(req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts × n={req.n} exceeds {MAX_CHOICES} choices", "n")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    out = Prepared([], [], stops=_stops(req.stop), stream=req.stream, token_ids=req.return_token_ids)
    out.logprobs = req.logprobs is not None
    for p, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else None
        probe = _generate("", adapter, _sampling(req, max_tokens, 0), prompt) if text is None else None
        probe = probe or GenerateRequest(
            request_id="", prompt=text, adapter=adapter, sampling=_sampling(req, max_tokens, 0)
        )
        try:
            check_request(probe, vocab_size=ctx.vocab_size, adapters=ctx.adapters)
            check_prompt_size(probe, max_prompt_bytes=ctx.max_prompt_bytes, max_model_len=ctx.max_model_len)
            if text is not None and len(text) > THREAD_TOKENIZE_CHARS:
                ids = await asyncio.to_thread(encode_prompt, probe, ctx.tokenizer)
            else:
                ids = encode_prompt(probe, ctx.tokenizer)
            check_prompt(ids, probe, max_model_len=ctx.max_model_len, vocab_size=ctx.vocab_size)
        except Rejected as exc:
            raise _rejected(exc) from None
        echo = (text if text is not None else ctx.tokenizer.decode(ids)) if req.echo else ""
        out.distinct_prompt_tokens += len(ids)
        for i in range(req.n):
            rid = f"{p}-{i}-{uuid.uuid4().hex[:8]}"
            out.requests.append(_generate(rid, adapter, _sampling(req, max_tokens, i), ids))
            out.prompt_tokens.append(len(ids))
            out.echo.append(echo)
    out.include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return out


def _message_dict(msg: Any) -> dict[str, Any]:
    content = msg.content
    if isinstance(content, list):  # content parts: only text is understood by a text-only model
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400, f"message content part of type {part.get('type')!r} is not supported", "messages"
                )
            texts.append(part["text"])
        content = "".join(texts)
    for name in ("audio", "function_call"):
        if getattr(msg, name) is not None:
            raise unsupported_field(f"messages.{name}")
    out = msgspec.structs.asdict(msg)
    out["content"] = content if content is not None else ""
    return {k: v for k, v in out.items() if v is not None and k not in ("refusal", "annotations")}


def render_chat(messages: list[Any], add_generation_prompt: bool, ctx: Context) -> str:
    """The conversation through the model's chat template, refused by its size (as a text prompt is)
    before anyone tokenizes it."""
    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    try:
        text = ctx.chat_template.render([_message_dict(m) for m in messages], add_generation_prompt)
    except TemplateError as exc:
        raise ApiError(400, str(exc), "messages") from None
    most = ctx.max_prompt_bytes
    if len(text) * 4 > most and (nbytes := len(text.encode())) > most:
        raise ApiError(
            400,
            f"the rendered messages are {nbytes} bytes, more than the server's limit of {most} bytes for "
            f"a prompt (more tokens than the {ctx.max_model_len}-token context holds)",
            "messages",
        )
    return text


async def prepare_chat(req: ChatCompletionRequest, ctx: Context) -> Prepared:
    _check_fields(req)
    adapter = resolve_model(req.model, ctx)
    text = render_chat(req.messages, req.add_generation_prompt, ctx)
    ids = await tokenize_text(text, ctx.tokenizer, add_special_tokens=False)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = limit if limit is not None else max(ctx.max_model_len - len(ids), 1)
    out = Prepared([], [], stops=_stops(req.stop), stream=req.stream, distinct_prompt_tokens=len(ids))
    out.token_ids = req.return_token_ids
    out.logprobs = req.logprobs
    for i in range(req.n):
        gen = _generate(f"{i}-{uuid.uuid4().hex[:8]}", adapter, _sampling(req, max_tokens, i), ids)
        try:
            check_request(gen, vocab_size=ctx.vocab_size, adapters=ctx.adapters)
            check_prompt(ids, gen, max_model_len=ctx.max_model_len, vocab_size=ctx.vocab_size)
        except Rejected as exc:
            raise _rejected(exc) from None
        out.requests.append(gen)
        out.prompt_tokens.append(len(ids))
        out.echo.append("")
    out.include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return out
