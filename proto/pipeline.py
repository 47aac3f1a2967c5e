"""Request-path messages: tokenizer → scheduler (PUSH/PULL), scheduler → tokenizer (PUSH/PULL) and
worker → tokenizer (PUSH/PULL). Adapter control ops carry a tokenizer-chosen `op_id` that the reply echoes."""

from __future__ import annotations

from typing import Literal

import msgspec

from proto.base import Message, Record, TokenIds, edge
from proto.client import AdapterEntry, ErrorKind, FinishReason, StageHealth, TokenLogprobs
from proto.sampling import SamplingParams

# --- tokenizer -> scheduler ------------------------------------------------------------------------


class TokenizedRequest(Message):
    """A validated request: from here on the pipeline knows it only by request_id."""

    request_id: str
    prompt_ids: TokenIds
    adapter: str | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    arrival_time: float = 0.0  # tokenizer's time.monotonic() when the client request arrived


class AbortRequest(Message):
    """Client aborted or disconnected: free the request's pages and adapter reference; no reply."""

    request_id: str


class LoadAdapterOp(Message):
    op_id: int
    name: str
    path: str


class UnloadAdapterOp(Message):
    op_id: int
    name: str


class ListAdaptersOp(Message):
    op_id: int


class HealthProbe(Message):
    """Answered by HealthStatus with the scheduler's view of itself, the worker and the loader."""

    op_id: int


# --- scheduler -> tokenizer ------------------------------------------------------------------------


class OpDone(Message):
    """An adapter control op succeeded (the tokenizer answers the client with Ack)."""

    op_id: int


class OpFailed(Message):
    op_id: int
    kind: ErrorKind
    message: str


class AdapterListing(Message):
    op_id: int
    adapters: list[AdapterEntry]


class HealthStatus(Message):
    op_id: int
    stages: list[StageHealth]


class RequestFailed(Message):
    """The scheduler (or the worker, through it) gave up on a request; the tokenizer tells its client
    and drops the request's state. Sent e.g. when its adapter failed to load."""

    request_id: str
    kind: ErrorKind
    message: str


class AdapterUpdate(Message):
    """The registry changed: the tokenizer validates adapter names against the names it learnt this
    way. Sent before the OpDone of the op that caused it (same socket, so ordered)."""

    name: str
    state: Literal["registered", "unloading", "removed"]


# --- worker -> tokenizer ---------------------------------------------------------------------------


class TokenDelta(Record):
    request_id: str
    token_ids: list[int]  # new tokens of this step (already cut at a stop token / max_tokens)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them
    # with prompt_logprobs: one per prompt token after the first, with the request's first token
    prompt_logprobs: list[TokenLogprobs] | None = None


class TokenBatch(Message):
    """All new tokens of one worker step, in one message."""

    step: int
    items: list[TokenDelta]


TokenizerToScheduler = edge(
    "tokenizer_to_scheduler",
    TokenizedRequest,
    AbortRequest,
    LoadAdapterOp,
    UnloadAdapterOp,
    ListAdaptersOp,
    HealthProbe,
)
SchedulerToTokenizer = edge(
    "scheduler_to_tokenizer", OpDone, OpFailed, AdapterListing, HealthStatus, RequestFailed, AdapterUpdate
)
WorkerToTokenizer = edge("worker_to_tokenizer", TokenBatch)
