"""The tokenizer's open requests: who asked (client identity), their detokenizer, timings, and how a
worker TokenDelta becomes the TokenChunk that client is sent."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from proto.client import TokenChunk, TokenLogprobs
from proto.pipeline import TokenDelta
from stages.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class OpenRequest:
    request_id: str
    identity: bytes
    stream: bool
    detok: IncrementalDetokenizer
    prompt_tokens: int
    arrival: float
    first_token: float = 0.0
    num_output: int = 0
    texts: list[str] = field(default_factory=list)  # non-streaming: the completion so far
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # non-streaming, when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # non-streaming, until the whole completion goes

    def output(self, item: TokenDelta, now: float) -> TokenChunk | None:
        """Detokenize new tokens; the chunk to send now, or None (nothing final yet / not streaming)."""
        if item.token_ids and not self.first_token:
            self.first_token = now
        self.num_output += len(item.token_ids)
        finished = item.finish_reason is not None
        text = self.detok.step(item.token_ids) + (self.detok.flush() if finished else "")
        logprobs, prompt_lps = item.logprobs, item.prompt_logprobs
        if not self.stream:
            if prompt_lps is not None:
                self.prompt_logprobs = prompt_lps
            self.texts.append(text)
            self.ids.extend(item.token_ids)
            if logprobs is not None:
                self.logprobs = self.logprobs if self.logprobs is not None else []
                self.logprobs.extend(logprobs)
            if not finished:
                return None
            text, ids, logprobs = "".join(self.texts), self.ids, self.logprobs
            prompt_lps = self.prompt_logprobs
        else:
            ids = list(item.token_ids)
            if not (text or ids or finished or prompt_lps):
                return None
        return TokenChunk(
            request_id=self.request_id,
            text=text,
            token_ids=ids,
            finished=finished,
            finish_reason=item.finish_reason,
            prompt_tokens=self.prompt_tokens,
            num_output_tokens=self.num_output,
            arrival_time=self.arrival,
            first_token_time=self.first_token,
            sent_time=time.monotonic(),
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
        )


class RequestTable:
    """Open requests by id and by client; `idle` is set while there are none (drain waits on it)."""

    def __init__(self) -> None:
        self.by_id: dict[str, OpenRequest] = {}
        self.by_client: dict[bytes, set[str]] = {}
        self.idle = asyncio.Event()
        self.idle.set()

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, rid: str) -> bool:
        return rid in self.by_id

    def get(self, rid: str) -> OpenRequest | None:
        return self.by_id.get(rid)

    def add(self, req: OpenRequest) -> None:
        self.by_id[req.request_id] = req
        self.by_client.setdefault(req.identity, set()).add(req.request_id)
        self.idle.clear()

    def pop(self, rid: str) -> OpenRequest | None:
        req = self.by_id.pop(rid, None)
        if req is None:
            return None
        ids = self.by_client.get(req.identity)
        if ids is not None:
            ids.discard(rid)
            if not ids:
                del self.by_client[req.identity]
        if not self.by_id:
            self.idle.set()
        return req

    def of_client(self, identity: bytes) -> list[str]:
        return list(self.by_client.get(identity, ()))
