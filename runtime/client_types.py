"""What the client SDK hands its callers: the typed errors, one per server error kind (plus Timeout
and Unauthorized from the client's side), the Chunk/Timings/Completion results, and the checks that
turn an unsendable request (bad sampling values, a lone surrogate, a bad name) into InvalidRequest."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from proto.base import TokenIds
from proto.client import ErrorReply, GenerateRequest, LoadAdapter, TokenLogprobs
from proto.sampling import SamplingParams
from runtime.common.names import adapter_name_problem

Prompt = str | Sequence[int]  # text, or token ids used as given


class LorapipeError(Exception):
    """Base of every error the SDK raises; str(e) is the server's message."""


class InvalidRequest(LorapipeError): ...


class UnknownAdapter(LorapipeError): ...


class AdapterLoadFailed(LorapipeError): ...


class ServerError(LorapipeError): ...


class Aborted(LorapipeError): ...


class ProtocolMismatchError(LorapipeError): ...


class Timeout(LorapipeError, TimeoutError): ...


class ServerUnreachable(Timeout, ConnectionError):
    """No lorapipe server answered the connection handshake; the message names the address and why."""


class Forbidden(LorapipeError):
    """The server's configuration refuses the operation (runtime loading off, path outside its root)."""


class Unauthorized(LorapipeError):
    """The server refused the connection's credentials: API key missing, wrong, or not expected."""


class AdapterTimeout(LorapipeError, TimeoutError):
    """The request's adapter made no progress towards the GPU within the server's adapter-wait timeout;
    the message names the adapter and the tier it waited on."""


class StageFailed(ServerError):
    """A server stage failed on a message this request depended on; the message names the stage."""


_ERRORS: dict[str, type[LorapipeError]] = {
    "invalid_request": InvalidRequest,
    "unknown_adapter": UnknownAdapter,
    "adapter_load_failed": AdapterLoadFailed,
    "server_error": ServerError,
    "aborted": Aborted,
    "protocol_mismatch": ProtocolMismatchError,
    "forbidden": Forbidden,
    "adapter_timeout": AdapterTimeout,
    "stage_failed": StageFailed,
}


@dataclass(frozen=True)
class Chunk:
    """Output of one request as it arrives; `time` is seconds since the request was sent (client clock)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    time: float
    prompt_tokens: int = 0
    server_ttft: float = 0.0  # tokenizer arrival → first token, server clock (0 until known)
    # with logprobs=k: one per token of token_ids (its log-probability and the k likeliest tokens')
    logprobs: list[TokenLogprobs] | None = None
    # with prompt_logprobs=k: one per prompt token after the first (its rank too), in the first chunk
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class Timings:
    ttft: float  # seconds from send to the first token (client clock)
    token_times: list[float]  # per output token: seconds from send to its arrival
    e2e: float  # seconds from send to the final chunk
    server_ttft: float = 0.0

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    timings: Timings = field(repr=False)
    logprobs: list[TokenLogprobs] | None = None  # with logprobs=k: one per token of token_ids
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt_logprobs=k: prompt tokens after the first


def error_from_reply(reply: ErrorReply) -> LorapipeError:
    return _ERRORS.get(reply.kind, ServerError)(reply.message)


def make_request(prompt: Prompt, adapter: str | None, sampling: dict[str, Any]) -> GenerateRequest:
    try:
        params = msgspec.convert(sampling, SamplingParams)
        params.validate()
    except (msgspec.ValidationError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc}") from None
    if adapter is not None:
        check_name(adapter)
    rid = uuid.uuid4().hex
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        return GenerateRequest(request_id=rid, prompt=prompt, adapter=adapter, sampling=params)
    try:
        ids = TokenIds.of(prompt)
    except (TypeError, OverflowError) as exc:
        raise InvalidRequest(f"prompt token ids must be int32 integers: {exc}") from None
    return GenerateRequest(request_id=rid, prompt_ids=ids, adapter=adapter, sampling=params)


def check_name(name: object) -> None:
    problem = adapter_name_problem(name)
    if problem is not None:
        raise InvalidRequest(problem)


SIZE_SLACK_BYTES = 64 << 10  # more than a request's fields besides its prompt can take (names, stop ids)


def request_size(req: GenerateRequest | LoadAdapter, limit: int, encode: Callable[[Any], list[Any]]) -> int:
    """`req`'s encoded size when it may exceed `limit` (then encoded with `encode`, to frames), else a
    bound below the limit: a text's UTF-8 bytes are at most 4 per character, token ids 4 bytes each."""
    if isinstance(req, LoadAdapter):
        bound = SIZE_SLACK_BYTES + 4 * (len(req.name) + len(req.path))
    else:
        bound = SIZE_SLACK_BYTES + (4 * len(req.prompt) if req.prompt is not None else 0)
        bound += 4 * len(req.prompt_ids) if req.prompt_ids is not None else 0
    if bound <= limit:
        return bound
    return sum(memoryview(f).nbytes for f in encode(req))


def check_text(text: object, what: str) -> None:
    if not isinstance(text, str):
        raise InvalidRequest(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{what} is not valid Unicode text (a lone surrogate at {exc.start})") from None
