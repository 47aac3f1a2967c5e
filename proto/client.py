"""Client ⇄ tokenizer messages (DEALER → tokenizer ROUTER and back). Every request carries a
client-chosen `request_id` (unique per client connection) that its replies echo.
`Hello`, `Welcome` and `ErrorReply` never change shape, so a version mismatch is always reported."""

from __future__ import annotations

from typing import Literal

import msgspec

from proto.base import Message, Record, TokenIds, edge
from proto.sampling import SamplingParams

ErrorKind = Literal[
    "invalid_request",  # bad sampling value, prompt too long, malformed message, ...
    "unknown_adapter",  # the named adapter is not registered (or is being unloaded)
    "adapter_load_failed",  # reading/validating the adapter failed; the message says why
    "server_error",  # a stage failed or is shutting down
    "aborted",  # the request was aborted server-side
    "protocol_mismatch",  # client and server speak different PROTOCOL_VERSIONs
    "forbidden",  # the server's configuration refuses the operation (runtime loading off, path outside root)
    "adapter_timeout",  # the request's adapter made no progress for --adapter-wait-timeout (names the tier)
    "stage_failed",  # a stage's handler failed on a message this request depended on (names the stage)
]
FinishReason = Literal["stop", "length", "abort"]
Tier = Literal["gpu", "host", "disk", "loading"]


# --- client -> tokenizer ---------------------------------------------------------------------------


class Hello(Message):
    """First message of a connection; answered by Welcome, or ErrorReply(kind="protocol_mismatch")."""

    request_id: str
    protocol_version: int


class GenerateRequest(Message):
    """Exactly one of `prompt` (text, tokenized server-side) or `prompt_ids` (used as given)."""

    request_id: str
    prompt: str | None = None
    prompt_ids: TokenIds | None = None
    adapter: str | None = None  # None = base model only
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = True  # False: one TokenChunk with the whole completion at the end


class Abort(Message):
    """Stop a running request; no reply. Sent by the SDK when a stream is closed early."""

    request_id: str


class LoadAdapter(Message):
    """Register (and stage) a PEFT adapter dir under `name`; answered by Ack or ErrorReply."""

    request_id: str
    name: str
    path: str


class UnloadAdapter(Message):
    """Unregister `name`: running requests that use it finish, new ones are refused; Ack or ErrorReply."""

    request_id: str
    name: str


class ListAdapters(Message):
    request_id: str


class Health(Message):
    request_id: str


# --- tokenizer -> client ---------------------------------------------------------------------------


class Welcome(Message):
    request_id: str
    protocol_version: int
    model: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    max_request_bytes: int = 0  # the largest message the server accepts (--max-request-bytes); 0: unsaid


class TokenLogprobs(Record):
    """One output token's log-probability under the model's raw logits, and the most likely tokens'
    (as many as the request's SamplingParams.logprobs, most likely first)."""

    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)
    rank: int = 0  # prompt tokens: 1 + how many tokens the logits rank above it (0: not computed)


class TokenChunk(Message):
    """New output of one request. Streaming: the delta since the previous chunk; non-streaming: the
    whole completion in one finished chunk. Times are the server's `time.monotonic()` seconds."""

    request_id: str
    text: str  # detokenized text; may lag token_ids while a multi-byte character is incomplete
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative, including this chunk
    arrival_time: float = 0.0  # when the tokenizer accepted the request
    first_token_time: float = 0.0  # when the tokenizer received the request's first output token
    sent_time: float = 0.0  # when this chunk left the tokenizer
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when the request asked
    # with SamplingParams.prompt_logprobs: one per prompt token after the first, in the first chunk
    # (streaming) or the whole completion
    prompt_logprobs: list[TokenLogprobs] | None = None


class TokenChunks(Message):
    """The chunks of one worker step for one client's requests, in one message: a client streaming many
    requests at once gets one message per step instead of one per request. Each chunk means what it
    means alone. `request_id` is "" (the chunks carry theirs)."""

    chunks: list[TokenChunk]
    request_id: str = ""


class ErrorReply(Message):
    """The request failed; `kind` selects the client exception, `message` is meant for humans.
    request_id is "" when the offending message could not be decoded far enough to know it."""

    request_id: str
    kind: ErrorKind
    message: str


class AdapterEntry(Record):
    name: str
    path: str
    tier: Tier  # fastest place it is resident now
    slot: int | None = None  # GPU slot when tier == "gpu"
    state: str = "ready"  # "ready", "loading", "unloading", "failed"
    rank: int = 0
    active_requests: int = 0


class AdapterList(Message):
    request_id: str
    adapters: list[AdapterEntry]


class StageHealth(Record):
    stage: str  # "tokenizer", "scheduler", "worker", "loader"
    status: Literal["ok", "degraded", "down", "draining"]
    detail: str = ""
    warmup_done: int = 0  # the worker's kernel warm-up while it runs: steps done of warmup_total
    warmup_total: int = 0  # 0: no warm-up running


class HealthReply(Message):
    request_id: str
    ok: bool
    stages: list[StageHealth]


class Ack(Message):
    """Success of an adapter control op (LoadAdapter, UnloadAdapter)."""

    request_id: str


ClientRequest = edge(
    "client_to_tokenizer", Hello, GenerateRequest, Abort, LoadAdapter, UnloadAdapter, ListAdapters, Health
)
ClientReply = edge(
    "tokenizer_to_client", Welcome, TokenChunk, TokenChunks, ErrorReply, AdapterList, HealthReply, Ack
)
