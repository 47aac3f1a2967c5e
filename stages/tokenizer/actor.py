"""The tokenizer stage actor. Sockets: client ROUTER, PULLs from scheduler and worker (all bound), PUSH
to the scheduler. Mailboxes in: client_requests, scheduler_events, token_batches; out: client_replies,
to_scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from proto.base import PROTOCOL_VERSION, TokenIds
from proto.client import (
    Abort,
    Ack,
    AdapterList,
    ClientReply,
    ClientRequest,
    ErrorKind,
    ErrorReply,
    GenerateRequest,
    Health,
    HealthReply,
    Hello,
    ListAdapters,
    LoadAdapter,
    StageHealth,
    TokenChunk,
    TokenChunks,
    UnloadAdapter,
    Welcome,
)
from proto.codec import ProtocolError
from proto.pipeline import (
    AbortRequest,
    AdapterListing,
    AdapterUpdate,
    HealthProbe,
    HealthStatus,
    ListAdaptersOp,
    LoadAdapterOp,
    OpDone,
    OpFailed,
    RequestFailed,
    SchedulerToTokenizer,
    TokenBatch,
    TokenDelta,
    TokenizedRequest,
    TokenizerToScheduler,
    UnloadAdapterOp,
    WorkerToTokenizer,
)
from runtime.base.actor import Actor
from runtime.base.sockets import MAX_CLIENT_FRAMES, PeerGone, PullSocket, PushSocket, RouterSocket
from stages.tokenizer.adapter_ops import check_adapter_op
from stages.tokenizer.config import TokenizerConfig
from stages.tokenizer.detokenizer import IncrementalDetokenizer
from stages.tokenizer.failures import fail_dependents, fail_open
from stages.tokenizer.local_clients import LocalClients
from stages.tokenizer.metrics import TokenizerMetrics
from stages.tokenizer.requests import OpenRequest, RequestTable
from stages.tokenizer.tokenizing import ApartTokenizer
from stages.tokenizer.validate import (
    Rejected,
    check_prompt,
    check_prompt_size,
    check_request,
    encode_prompt,
    peek_request_id,
    prompt_byte_limit,
)

THREAD_TOKENIZE_CHARS = 8192  # longer texts are tokenized in a thread, beside other requests
TOKENIZE_THREADS = 2
MAX_REQUEST_ID = 256


class TokenizerActor(Actor[TokenizerConfig]):
    stage = "tokenizer"

    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__(config)
        self.tokenizer = Tokenizer.from_file(str(Path(config.model_dir) / "tokenizer.json"))
        self.requests = RequestTable()
        self.adapters: dict[str, str] = {name: "registered" for name in config.adapters}
        self.ops: dict[int, tuple[bytes, Any]] = {}  # op_id -> (client identity, client request)
        self._op_ids = itertools.count(1)
        self.local = LocalClients()  # in-process clients: the HTTP front end
        self.http: Any = None  # the HTTP front end, made by setup() when --port is set
        self.client: RouterSocket | None = None  # bound by setup()
        self.client_requests = self.mailbox("client_requests")
        self.scheduler_events = self.mailbox("scheduler_events")
        self.token_batches = self.mailbox("token_batches")
        self.client_replies = self.mailbox("client_replies")
        self.to_scheduler = self.mailbox("to_scheduler")
        self.max_prompt_bytes = prompt_byte_limit(
            self.tokenizer, config.max_model_len, config.max_prompt_bytes
        )
        self.tokenizing = ApartTokenizer(
            self.tokenizer, TOKENIZE_THREADS, config.max_tokenizing_bytes, self._admit, self._reject
        )
        self.series = TokenizerMetrics(self.metrics, lambda: len(self.requests))

    async def setup(self) -> None:
        ep, cfg = self.config.endpoints, self.config
        self.client = self.socket(
            RouterSocket(
                ep.client,
                ClientRequest,
                ClientReply,
                max_msg_bytes=cfg.max_client_msg_bytes,
                max_frames=MAX_CLIENT_FRAMES,
                api_key=cfg.api_key,
            )
        )
        to_scheduler = self.socket(PushSocket(ep.tokenizer_to_scheduler, TokenizerToScheduler))
        from_scheduler = self.socket(PullSocket(ep.scheduler_to_tokenizer, SchedulerToTokenizer))
        from_worker = self.socket(PullSocket(ep.worker_to_tokenizer, WorkerToTokenizer))
        self.add_receiver("client", self.client, self.client_requests)
        self.add_receiver("scheduler", from_scheduler, self.scheduler_events)
        self.add_receiver("worker", from_worker, self.token_batches)
        self.add_handler("client_requests", self.client_requests, self.handle_client)
        self.add_handler("scheduler_events", self.scheduler_events, self.handle_scheduler)
        self.add_handler("token_batches", self.token_batches, self.handle_tokens)
        self.add_sender("client", self.client_replies, self._send_reply)
        self.add_sender("scheduler", self.to_scheduler, to_scheduler.send)
        if cfg.http_port:
            from stages.tokenizer.http import HttpFrontEnd

            self.http = HttpFrontEnd(self)  # binds --host/--port now: a taken port fails start-up
            self.add_loop("http", self.http.serve)

    def ready_note(self) -> str:
        if self.http is None:
            return ""
        host = self.config.http_host
        host = f"[{host}]" if ":" in host else host
        return f"; OpenAI-compatible HTTP at http://{host}:{self.config.http_port}/v1"

    async def submit(self, identity: bytes, msg: Any) -> None:
        """A message from an in-process client (`self.local`), handled as if the ROUTER had received it;
        the replies go to that client's queue."""
        await self.client_requests.put((identity, msg))

    # --- client requests ------------------------------------------------------------------------------
    async def handle_client(self, item: tuple[bytes, Any]) -> None:
        identity, msg = item
        if len(msg.request_id) > MAX_REQUEST_ID:
            text = f"request_id is {len(msg.request_id)} characters long (at most {MAX_REQUEST_ID})"
            return await self._error(identity, msg.request_id[:MAX_REQUEST_ID], "invalid_request", text)
        match msg:
            case Hello():
                await self.on_hello(identity, msg)
            case GenerateRequest():
                await self.on_generate_request(identity, msg)
            case Abort():
                await self.on_abort(identity, msg)
            case LoadAdapter() | UnloadAdapter():
                await self.on_adapter_op(identity, msg)
            case ListAdapters():
                await self._forward_op(identity, msg, lambda op: ListAdaptersOp(op_id=op))
            case Health():
                op_id = await self._forward_op(identity, msg, lambda op: HealthProbe(op_id=op))
                asyncio.get_running_loop().call_later(
                    self.config.health_timeout_s, self._health_expired, op_id
                )

    async def on_hello(self, identity: bytes, msg: Hello) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            text = f"client speaks protocol {msg.protocol_version}, server speaks {PROTOCOL_VERSION}"
            return await self._error(identity, msg.request_id, "protocol_mismatch", text)
        cfg = self.config
        welcome = Welcome(
            request_id=msg.request_id,
            protocol_version=PROTOCOL_VERSION,
            model=cfg.model_name,
            max_model_len=cfg.max_model_len,
            vocab_size=cfg.vocab_size,
            max_request_bytes=cfg.max_client_msg_bytes,
        )
        await self.client_replies.put((identity, welcome))

    async def on_adapter_op(self, identity: bytes, msg: LoadAdapter | UnloadAdapter) -> None:
        cfg = self.config
        try:
            path = check_adapter_op(
                msg,
                runtime_loading=cfg.runtime_adapter_loading,
                adapter_root=cfg.adapter_root,
                allow_any_path=cfg.allow_any_adapter_path,
            )
        except Rejected as exc:
            return await self._error(identity, msg.request_id, exc.kind, exc.message)
        name = msg.name
        if path is not None:
            await self._forward_op(identity, msg, lambda op: LoadAdapterOp(op_id=op, name=name, path=path))
        else:
            await self._forward_op(identity, msg, lambda op: UnloadAdapterOp(op_id=op, name=name))

    async def on_generate_request(self, identity: bytes, msg: GenerateRequest) -> None:
        rid = msg.request_id
        if self.draining:
            return await self._error(identity, rid, "server_error", self._shutdown_message())
        if rid in self.requests or rid in self.tokenizing:
            return await self._error(
                identity, rid, "invalid_request", f"request_id {rid!r:.200} is already running"
            )
        cfg = self.config
        try:  # the cheap checks, before any tokenizing
            check_request(msg, vocab_size=cfg.vocab_size, adapters=self.adapters)
            check_prompt_size(msg, max_prompt_bytes=self.max_prompt_bytes, max_model_len=cfg.max_model_len)
        except Rejected as exc:
            return await self._reject(identity, rid, exc)
        if msg.prompt is not None and len(msg.prompt) > THREAD_TOKENIZE_CHARS:
            return self.tokenizing.start(identity, msg)
        await self._admit(identity, msg, encode_prompt(msg, self.tokenizer))

    async def _reject(self, identity: bytes, rid: str, exc: Rejected) -> None:
        self.series.requests.labels(outcome=f"rejected_{exc.kind}").inc()
        await self._error(identity, rid, exc.kind, exc.message)

    async def _admit(self, identity: bytes, msg: GenerateRequest, ids: list[int]) -> None:
        rid, cfg = msg.request_id, self.config
        if self.draining:
            return await self._error(identity, rid, "server_error", self._shutdown_message())
        try:
            check_prompt(ids, msg, max_model_len=cfg.max_model_len, vocab_size=cfg.vocab_size)
        except Rejected as exc:
            return await self._reject(identity, rid, exc)
        now = time.monotonic()
        detok = IncrementalDetokenizer(self.tokenizer, ids)
        self.requests.add(OpenRequest(rid, identity, msg.stream, detok, len(ids), now))
        self.series.prompt.observe(len(ids))
        tokenized = TokenizedRequest(
            request_id=rid,
            prompt_ids=TokenIds.of(ids),
            adapter=msg.adapter,
            sampling=msg.sampling,
            arrival_time=now,
        )
        await self.to_scheduler.put(tokenized)

    async def on_abort(self, identity: bytes, msg: Abort) -> None:
        if self.tokenizing.cancel(msg.request_id, identity):
            return
        req = self.requests.get(msg.request_id)
        if req is not None and req.identity == identity:
            await self._abort(msg.request_id, outcome="aborted")

    async def _forward_op(self, identity: bytes, msg: Any, make: Any) -> int:
        op_id = next(self._op_ids)
        self.ops[op_id] = (identity, msg)
        await self.to_scheduler.put(make(op_id))
        return op_id

    def _health_expired(self, op_id: int) -> None:
        """The scheduler did not answer a probe: report it down ourselves (a late answer is ignored)."""
        if op_id in self.ops:
            detail = f"no answer within {self.config.health_timeout_s}s"
            down = StageHealth(stage="scheduler", status="down", detail=detail)
            with contextlib.suppress(asyncio.QueueFull):  # overloaded: the client's timeout covers it
                self.scheduler_events.put_nowait(HealthStatus(op_id=op_id, stages=[down]))

    # --- scheduler events -----------------------------------------------------------------------------
    async def handle_scheduler(self, msg: Any) -> None:
        match msg:
            case AdapterUpdate(name=name, state="removed"):
                self.adapters.pop(name, None)
            case AdapterUpdate(name=name, state=state):
                self.adapters[name] = state
            case OpDone(op_id=op_id):
                await self._answer_op(op_id, lambda rid: Ack(request_id=rid))
            case OpFailed(op_id=op_id, kind=kind, message=text):
                await self._answer_op(op_id, lambda rid: ErrorReply(request_id=rid, kind=kind, message=text))
            case AdapterListing(op_id=op_id, adapters=entries):
                await self._answer_op(op_id, lambda rid: AdapterList(request_id=rid, adapters=entries))
            case HealthStatus(op_id=op_id, stages=stages):
                status = "draining" if self.draining else "degraded" if self.handler_failures else "ok"
                own = StageHealth(stage=self.stage, status=status)
                every = [own, *stages]
                ok = all(s.status == "ok" for s in every)
                await self._answer_op(op_id, lambda rid: HealthReply(request_id=rid, ok=ok, stages=every))
            case RequestFailed(request_id=rid, kind=kind, message=text):
                req = self._drop(rid, outcome=f"failed_{kind}")
                if req is not None:
                    await self._error(req.identity, rid, kind, text)

    async def _answer_op(self, op_id: int, make: Any) -> None:
        entry = self.ops.pop(op_id, None)
        if entry is not None:
            identity, request = entry
            await self.client_replies.put((identity, make(request.request_id)))

    # --- worker output --------------------------------------------------------------------------------
    async def handle_tokens(self, batch: TokenBatch) -> None:
        """One worker step: each client gets its requests' chunks in one message (a TokenChunks when it
        has several), so the cost per step is one send per client rather than one per request."""
        now = time.monotonic()
        by_client: dict[bytes, list[TokenChunk]] = {}
        tokens = 0
        for item in batch.items:
            req = self.requests.get(item.request_id)
            if req is None:  # aborted or failed meanwhile; late tokens are dropped
                continue
            tokens += len(item.token_ids)
            chunk = self._output(item, req, now)
            if chunk is not None:
                by_client.setdefault(req.identity, []).append(chunk)
        self.series.output.inc(tokens)
        for identity, chunks in by_client.items():
            await self.client_replies.put(
                (identity, chunks[0] if len(chunks) == 1 else TokenChunks(chunks=chunks))
            )

    def _output(self, item: TokenDelta, req: OpenRequest, now: float) -> TokenChunk | None:
        first = not req.first_token
        chunk = req.output(item, now)
        if first and req.first_token:
            self.series.ttft.observe(req.first_token - req.arrival)
        if item.finish_reason is not None:
            self._drop(item.request_id, outcome="finished")
            self.series.e2e.observe(now - req.arrival)
        return chunk

    # --- state, errors, disconnects -------------------------------------------------------------------
    def _drop(self, rid: str, outcome: str) -> OpenRequest | None:
        req = self.requests.pop(rid)
        if req is not None:
            self.series.requests.labels(outcome=outcome).inc()
        return req

    async def _abort(self, rid: str, outcome: str) -> None:
        if self._drop(rid, outcome) is not None:
            await self.to_scheduler.put(AbortRequest(request_id=rid))

    async def _error(self, identity: bytes, rid: str, kind: ErrorKind, message: str) -> None:
        await self.client_replies.put((identity, ErrorReply(request_id=rid, kind=kind, message=message)))

    async def _send_reply(self, item: tuple[bytes, Any]) -> None:
        identity, msg = item
        if self.local.is_local(identity):
            if not self.local.deliver(identity, msg):
                await self._client_gone(identity)
            return
        try:
            await self.client.send(identity, msg)
        except PeerGone as exc:  # disconnected, or so far behind that its queue is full (PeerBusy)
            if identity in self.requests.by_client:
                self.log.warning("client %s; dropping its requests", exc)
            await self._client_gone(identity)

    async def _client_gone(self, identity: bytes) -> None:
        """The client disconnected: free its requests everywhere and forget its pending ops."""
        for rid in self.requests.of_client(identity):
            await self._abort(rid, outcome="disconnected")
        for op_id in [op for op, (who, _) in self.ops.items() if who == identity]:
            del self.ops[op_id]
        self.tokenizing.forget_client(identity)

    async def on_malformed(self, socket: str, exc: ProtocolError) -> None:
        await super().on_malformed(socket, exc)
        if socket == "client" and exc.identity is not None:
            rid = peek_request_id(exc.body)
            await self._error(exc.identity, rid, "invalid_request", f"malformed message: {exc}")

    async def on_handler_failed(self, queue: str, item: Any, exc: Exception) -> None:
        await fail_dependents(self, queue, item, exc)

    def _shutdown_message(self) -> str:
        reason = f": {self.shutdown_reason}" if self.shutdown_reason else ""
        return f"the server is shutting down{reason}"

    async def drain(self) -> None:
        """Refuse new requests (self.draining) and let open ones finish; fail those that do not in
        time, or at once when a stage failed (Shutdown.reason), so no client is left waiting."""
        if not self.shutdown_reason:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.drain_timeout * 0.8):
                    await self.requests.idle.wait()
        await fail_open(self)
        await super().drain()
        if self.http is not None:  # after the last replies are queued: let HTTP responses finish
            await self.http.shutdown()

    async def on_parent_died(self) -> None:
        """Fail open requests now (503 over HTTP, an error event in a stream), not leave them to uvicorn's
        bare 500 when the stage exits; refuse new ones; let the HTTP server send those answers."""
        self.draining, self.shutdown_reason = True, "its launcher died"
        self.drain_timeout = min(self.drain_timeout, 1.0)
        await fail_open(self)
        if self.http is not None:
            await self.http.shutdown()
