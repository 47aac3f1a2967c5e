"""Long prompts tokenized apart: each in a thread of a small pool (encode_batch releases the GIL), by
its own task, so the tokenizer's handler goes on with other connections meanwhile. Text waiting to be
tokenized is bounded in bytes overall; a request aborted, disconnected or drained meanwhile is dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from proto.client import GenerateRequest
from stages.tokenizer.validate import Rejected, encode_prompt

Admit = Callable[[bytes, GenerateRequest, list[int]], Awaitable[None]]
Refuse = Callable[[bytes, str, Rejected], Awaitable[None]]


@dataclass
class _Pending:
    identity: bytes
    task: asyncio.Future[None]
    size: int


class ApartTokenizer:
    def __init__(
        self, tokenizer: Tokenizer, threads: int, max_bytes: int, admit: Admit, refuse: Refuse
    ) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self._admit, self._refuse = admit, refuse
        self._slots = asyncio.Semaphore(threads)
        self._pending: dict[str, _Pending] = {}
        self._tasks: set[asyncio.Future[None]] = set()  # strong references until done

    def __contains__(self, rid: str) -> bool:
        return rid in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, identity: bytes, msg: GenerateRequest) -> None:
        """Tokenize `msg` apart, then `admit` it (or `refuse` it: too much text waiting, untokenizable)."""
        assert msg.prompt is not None
        rid, size = msg.request_id, len(msg.prompt)
        if size + sum(p.size for p in self._pending.values()) > self.max_bytes:
            text = "too many long prompts are being tokenized; retry later"
            self._keep(asyncio.ensure_future(self._refuse(identity, rid, Rejected("server_error", text))))
            return
        task = asyncio.ensure_future(self._run(identity, msg))
        self._keep(task)
        self._pending[rid] = _Pending(identity, task, size)

    def _keep(self, task: asyncio.Future[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, identity: bytes, msg: GenerateRequest) -> None:
        rid = msg.request_id
        try:
            async with self._slots:
                ids = await asyncio.to_thread(encode_prompt, msg, self.tokenizer)
        except Exception as exc:
            if self._pending.pop(rid, None) is not None:
                text = f"the prompt could not be tokenized: {type(exc).__name__}"
                await self._refuse(identity, rid, Rejected("invalid_request", text))
            return
        if self._pending.pop(rid, None) is not None:  # else aborted, disconnected or drained
            await self._admit(identity, msg, ids)

    def cancel(self, rid: str, identity: bytes) -> bool:
        """An Abort from the request's own client: forget it (its thread finishes, nothing follows)."""
        pending = self._pending.get(rid)
        if pending is None or pending.identity != identity:
            return False
        del self._pending[rid]
        return True

    def forget_client(self, identity: bytes) -> None:
        for rid in [rid for rid, p in self._pending.items() if p.identity == identity]:
            del self._pending[rid]

    def drain(self) -> list[tuple[str, bytes]]:
        """Stop everything pending; returns (request_id, client) of each, to be told why."""
        out = [(rid, p.identity) for rid, p in self._pending.items()]
        for p in self._pending.values():
            p.task.cancel()
        self._pending.clear()
        return out
