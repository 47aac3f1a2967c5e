"""The tokenizer stage in-process over ipc://, with the test playing scheduler and worker: streaming and
detokenization, validation errors beside good requests, aborts and disconnects, adapter ops,
malformed client frames, the version handshake and drain."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from proto.base import PROTOCOL_VERSION, TokenIds
from proto.client import (
    AdapterEntry,
    ClientReply,
    ClientRequest,
    ErrorReply,
    GenerateRequest,
    Hello,
    StageHealth,
    TokenChunk,
    TokenChunks,
    TokenLogprobs,
)
from proto.control import LauncherToStage, Shutdown, StageToLauncher, check_ready
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
    WorkerToTokenizer,
)
from runtime.base.endpoints import Endpoints
from runtime.base.sockets import DealerSocket, PullSocket, PushSocket, RouterSocket
from runtime.client import AdapterLoadFailed, AsyncClient, InvalidRequest, ServerError, UnknownAdapter
from stages.tokenizer import TokenizerActor, TokenizerConfig

pytestmark = pytest.mark.timeout(30)
TEXT = "日本語 😀 héllo"


class Pipeline:
    """A running TokenizerActor plus fake scheduler/worker sockets and a client."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.ep = Endpoints.in_run_dir(tmp, client=f"ipc://{tmp}/client.sock")
        cfg = TokenizerConfig.from_model_dir(
            model_dir,
            self.ep,
            adapters=("a",),
            allow_any_adapter_path=True,  # the fake loader answers for any path
            drain_timeout_s=5,
            health_timeout_s=0.2,
            control=self.ep.control,
        )
        self.actor = TokenizerActor(cfg)

    async def __aenter__(self) -> Pipeline:
        self.launcher = RouterSocket(self.ep.control, StageToLauncher, LauncherToStage)
        self.sched_in = PullSocket(self.ep.tokenizer_to_scheduler, TokenizerToScheduler)
        self.sched_out = PushSocket(self.ep.scheduler_to_tokenizer, SchedulerToTokenizer)
        self.worker = PushSocket(self.ep.worker_to_tokenizer, WorkerToTokenizer)
        self.task = asyncio.create_task(self.actor.run())
        self.identity, ready = await asyncio.wait_for(self.launcher.recv(), 10)
        check_ready(ready)
        self.client = AsyncClient(self.ep.client, timeout=10)
        await self.client.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        if not self.task.done():
            self.actor.request_drain()
            self.actor.request_drain()  # twice: stop now, whatever is still open
        assert await asyncio.wait_for(self.task, 10) == 0
        for sock in (self.sched_in, self.sched_out, self.worker, self.launcher):
            sock.close()

    async def scheduled(self, kind: type = TokenizedRequest) -> Any:
        msg = await asyncio.wait_for(self.sched_in.recv(), 10)
        assert isinstance(msg, kind), msg
        return msg

    async def tokens(self, rid: str, ids: list[int], finish: str | None = None) -> None:
        await self.worker.send(TokenBatch(step=0, items=[TokenDelta(rid, ids, finish)]))

    async def emit_text(self, tokenizer, rid: str, text: str) -> None:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        for i, tok in enumerate(ids):
            await self.tokens(rid, [tok], "stop" if i == len(ids) - 1 else None)


def _run(tmp_path, model_dir, body) -> None:
    async def main() -> None:
        async with Pipeline(tmp_path, model_dir) as p:
            await body(p)

    asyncio.run(main())


def test_one_message_per_client_and_step(tmp_path, model_dir, tokenizer):
    """A step's tokens for three requests of one raw client arrive as one TokenChunks, in the batch's
    order, each chunk that request's own text; a request of another client gets its own TokenChunk."""

    async def body(p: Pipeline) -> None:
        ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
        with (
            DealerSocket(p.ep.client, ClientReply, ClientRequest) as one,
            DealerSocket(p.ep.client, ClientReply, ClientRequest) as other,
        ):
            for rid in ("r0", "r1", "r2"):
                await one.send(GenerateRequest(request_id=rid, prompt_ids=TokenIds.of(ids[:2])))
                await p.scheduled()
            await other.send(GenerateRequest(request_id="o", prompt_ids=TokenIds.of(ids[:2])))
            await p.scheduled()
            texts: dict[str, str] = {"r0": "", "r1": "", "r2": "", "o": ""}
            for i, tok in enumerate(ids):
                finish = "stop" if i == len(ids) - 1 else None
                order = ["r2", "o", "r0", "r1"] if i % 2 else ["r0", "r1", "o", "r2"]
                await p.worker.send(TokenBatch(step=i, items=[TokenDelta(r, [tok], finish) for r in order]))
                packed = await asyncio.wait_for(one.recv(), 10)
                assert isinstance(packed, TokenChunks), packed
                assert [c.request_id for c in packed.chunks] == [r for r in order if r != "o"]
                assert all(c.token_ids == [tok] and c.finished == (finish is not None) for c in packed.chunks)
                alone = await asyncio.wait_for(other.recv(), 10)
                assert isinstance(alone, TokenChunk) and alone.request_id == "o"
                for c in [*packed.chunks, alone]:
                    texts[c.request_id] += c.text
            assert texts == dict.fromkeys(texts, TEXT)
        assert 'lorapipe_output_tokens_total{stage="tokenizer"} ' + f"{4.0 * len(ids)}" in (
            p.actor.metrics.exposition()
        )

    _run(tmp_path, model_dir, body)


def test_streams_detokenized_text_back(tmp_path, model_dir, tokenizer):
    async def body(p: Pipeline) -> None:
        gen = asyncio.create_task(p.client.generate("hello", adapter="a", max_tokens=20))
        req = await p.scheduled()
        assert req.prompt_ids.tolist() == tokenizer.encode("hello").ids and req.adapter == "a"
        assert req.sampling.max_tokens == 20
        await p.emit_text(tokenizer, req.request_id, TEXT)
        out = await gen
        assert out.text == TEXT and out.finish_reason == "stop" and out.prompt_tokens == len(req.prompt_ids)
        assert out.token_ids == tokenizer.encode(TEXT, add_special_tokens=False).ids
        # prompt given as ids skips tokenization; stream=False answers once, with everything
        with DealerSocket(p.ep.client, ClientReply, ClientRequest) as raw:
            ids = tokenizer.encode("hello").ids
            await raw.send(GenerateRequest(request_id="raw", prompt_ids=req.prompt_ids, stream=False))
            req2 = await p.scheduled()
            assert req2.prompt_ids.tolist() == ids
            await p.emit_text(tokenizer, "raw", TEXT)
            chunk = await asyncio.wait_for(raw.recv(), 10)
            assert isinstance(chunk, TokenChunk) and chunk.finished and chunk.text == TEXT
        text = p.actor.metrics.exposition()
        assert 'lorapipe_requests_total{outcome="finished",stage="tokenizer"} 2.0' in text
        # each request counted once, by how it ended
        assert re.findall(r"^lorapipe_requests_total\{.*", text, re.M) == [
            'lorapipe_requests_total{outcome="finished",stage="tokenizer"} 2.0'
        ]

    _run(tmp_path, model_dir, body)


def test_bad_requests_get_clear_errors_while_good_ones_complete(tmp_path, model_dir, tokenizer):
    async def body(p: Pipeline) -> None:
        good = asyncio.create_task(p.client.generate("hello"))
        req = await p.scheduled()
        with pytest.raises(UnknownAdapter, match="'nope'"):
            await p.client.generate("x", adapter="nope")
        with pytest.raises(InvalidRequest, match="temperature"):
            await p.client.generate("x", temperature=-1.0)
        with pytest.raises(InvalidRequest, match="context"):
            await p.client.generate("x", max_tokens=100)
        with pytest.raises(InvalidRequest, match="vocabulary"):
            await p.client.generate([1, 5000])
        await p.emit_text(tokenizer, req.request_id, "ok")
        assert (await good).text == "ok"
        # the scheduler may fail a request later (e.g. its adapter failed to load)
        failing = asyncio.create_task(p.client.generate("x", adapter="a"))
        req = await p.scheduled()
        await p.sched_out.send(
            RequestFailed(request_id=req.request_id, kind="adapter_load_failed", message="bad")
        )
        with pytest.raises(AdapterLoadFailed, match="bad"):
            await failing

    _run(tmp_path, model_dir, body)


def test_abort_and_disconnect_are_forwarded(tmp_path, model_dir, tokenizer):
    async def body(p: Pipeline) -> None:
        chunks = p.client.stream("hello")
        first = asyncio.create_task(anext(chunks))  # the request goes out on first iteration
        req = await p.scheduled()
        await p.tokens(req.request_id, tokenizer.encode("ab", add_special_tokens=False).ids)
        assert (await first).text == "ab"
        await chunks.aclose()
        assert await p.scheduled(AbortRequest) == AbortRequest(request_id=req.request_id)
        await p.tokens(req.request_id, [5], "length")  # late tokens of an aborted request are dropped

        raw = DealerSocket(p.ep.client, ClientReply, ClientRequest)
        await raw.send(GenerateRequest(request_id="gone", prompt="hello"))
        await p.scheduled()
        raw.close()
        # the ROUTER learns of the disconnect asynchronously; each send to the gone peer is a chance
        while True:
            await p.tokens("gone", [5])
            with contextlib.suppress(TimeoutError):
                msg = await asyncio.wait_for(p.sched_in.recv(), 0.2)
                assert msg == AbortRequest(request_id="gone")
                break

    _run(tmp_path, model_dir, body)


def test_adapter_ops_go_through_the_scheduler(tmp_path, model_dir, tokenizer):
    async def body(p: Pipeline) -> None:
        load = asyncio.create_task(p.client.load_adapter("b", "/ad/b"))
        op = await p.scheduled(LoadAdapterOp)
        assert (op.name, op.path) == ("b", "/ad/b")
        await p.sched_out.send(AdapterUpdate(name="b", state="registered"))
        await p.sched_out.send(OpDone(op_id=op.op_id))
        await load
        gen = asyncio.create_task(p.client.generate("x", adapter="b"))
        assert (await p.scheduled()).adapter == "b"
        await p.sched_out.send(AdapterUpdate(name="b", state="unloading"))
        listing = asyncio.create_task(p.client.list_adapters())  # ordered after the update
        op = await p.scheduled(ListAdaptersOp)
        entry = AdapterEntry(name="b", path="/ad/b", tier="gpu", slot=0, state="unloading")
        await p.sched_out.send(AdapterListing(op_id=op.op_id, adapters=[entry]))
        assert await listing == [entry]
        with pytest.raises(UnknownAdapter, match="being unloaded"):
            await p.client.generate("x", adapter="b")
        gen.cancel()
        await p.scheduled(AbortRequest)

        load = asyncio.create_task(p.client.load_adapter("c", "/bad"))
        op = await p.scheduled(LoadAdapterOp)
        await p.sched_out.send(
            OpFailed(op_id=op.op_id, kind="adapter_load_failed", message="DoRA unsupported")
        )
        with pytest.raises(AdapterLoadFailed, match="DoRA"):
            await load
        health = asyncio.create_task(p.client.health())
        op = await p.scheduled(HealthProbe)
        await p.sched_out.send(
            HealthStatus(op_id=op.op_id, stages=[StageHealth(stage="worker", status="ok")])
        )
        reply = await health
        assert reply.ok and [s.stage for s in reply.stages] == ["tokenizer", "worker"]

    _run(tmp_path, model_dir, body)


def test_malformed_frames_are_answered_and_the_server_keeps_serving(tmp_path, model_dir, tokenizer):
    async def body(p: Pipeline) -> None:
        with DealerSocket(p.ep.client, ClientReply, ClientRequest) as raw:
            await raw.sock.send_multipart([b"\xc1 garbage"])
            reply = await asyncio.wait_for(raw.recv(), 10)
            assert (
                isinstance(reply, ErrorReply) and reply.kind == "invalid_request" and reply.request_id == ""
            )
            bad = msgspec.msgpack.encode(["GenerateRequest", "r1", "hi", None, None, {"max_tokens": "x"}])
            await raw.sock.send_multipart([bad])
            reply = await asyncio.wait_for(raw.recv(), 10)
            assert (
                isinstance(reply, ErrorReply) and reply.request_id == "r1" and "max_tokens" in reply.message
            )
            await raw.send(Hello(request_id="h", protocol_version=PROTOCOL_VERSION + 1))
            reply = await asyncio.wait_for(raw.recv(), 10)
            assert isinstance(reply, ErrorReply) and reply.kind == "protocol_mismatch"
        good = asyncio.create_task(p.client.generate("hello"))
        await p.emit_text(tokenizer, (await p.scheduled()).request_id, "fine")
        assert (await good).text == "fine"
        assert 'lorapipe_messages_malformed_total{socket="client",stage="tokenizer"} 2.0' in (
            p.actor.metrics.exposition()
        )

    _run(tmp_path, model_dir, body)


def test_drain_refuses_new_requests_and_finishes_open_ones(tmp_path, model_dir, tokenizer):
    async def body(p: Pipeline) -> None:
        open_req = asyncio.create_task(p.client.generate("hello"))
        req = await p.scheduled()
        p.actor.request_drain()
        with pytest.raises(ServerError, match="shutting down"):
            await p.client.generate("late")
        await p.emit_text(tokenizer, req.request_id, "done")
        assert (await open_req).text == "done"
        assert await asyncio.wait_for(p.task, 10) == 0
        bound_by_tokenizer = (p.ep.client, p.ep.scheduler_to_tokenizer, p.ep.worker_to_tokenizer)
        assert not any(Path(a[len("ipc://") :]).exists() for a in bound_by_tokenizer)

    _run(tmp_path, model_dir, body)


def test_health_reports_a_silent_scheduler_as_down(tmp_path, model_dir, tokenizer):
    async def body(p: Pipeline) -> None:
        reply = await p.client.health()  # nobody answers the HealthProbe
        assert not reply.ok
        assert [(s.stage, s.status) for s in reply.stages] == [("tokenizer", "ok"), ("scheduler", "down")]

    _run(tmp_path, model_dir, body)


def test_shutdown_after_a_stage_failure_errors_open_requests_at_once(tmp_path, model_dir, tokenizer):
    async def body(p: Pipeline) -> None:
        open_req = asyncio.create_task(p.client.generate("hello"))
        await p.scheduled()
        await p.launcher.send(p.identity, Shutdown(deadline_s=5, reason="stage 'worker' died (exit 1)"))
        with pytest.raises(ServerError, match="stage 'worker' died"):
            await open_req
        assert await asyncio.wait_for(p.task, 10) == 0

    _run(tmp_path, model_dir, body)


def test_logprobs_travel_with_their_tokens(tmp_path, model_dir, tokenizer):
    """The worker's per-token logprobs reach the SDK's Completion (streamed) and a stream=False reply
    (gathered), one per token, in order; requests without them get None."""

    def lp(tok: int) -> TokenLogprobs:
        return TokenLogprobs(logprob=-tok / 100, top_ids=[tok, 1], top_logprobs=[-tok / 100, -5.0])

    async def body(p: Pipeline) -> None:
        ids = tokenizer.encode(TEXT, add_special_tokens=False).ids

        async def emit(rid: str) -> None:
            for i, tok in enumerate(ids):
                finish = "stop" if i == len(ids) - 1 else None
                delta = TokenDelta(request_id=rid, token_ids=[tok], finish_reason=finish, logprobs=[lp(tok)])
                await p.worker.send(TokenBatch(step=i, items=[delta]))

        gen = asyncio.create_task(p.client.generate("hello", max_tokens=20, logprobs=2))
        req = await p.scheduled()
        assert req.sampling.logprobs == 2
        await emit(req.request_id)
        out = await gen
        assert out.logprobs == [lp(t) for t in ids] and out.token_ids == ids
        with DealerSocket(p.ep.client, ClientReply, ClientRequest) as raw:
            await raw.send(GenerateRequest(request_id="raw", prompt_ids=TokenIds.of(ids[:2]), stream=False))
            await p.scheduled()
            await emit("raw")
            chunk = await asyncio.wait_for(raw.recv(), 10)
            assert isinstance(chunk, TokenChunk) and chunk.logprobs == [lp(t) for t in ids]
        plain = asyncio.create_task(p.client.generate("hello", max_tokens=20))
        await p.emit_text(tokenizer, (await p.scheduled()).request_id, TEXT)
        assert (await plain).logprobs is None

    _run(tmp_path, model_dir, body)


def test_health_carries_the_worker_warm_up_progress_to_the_sdk_and_http(tmp_path, model_dir, tokenizer):
    from stages.tokenizer.http.front import _stage

    async def body(p: Pipeline) -> None:
        health = asyncio.create_task(p.client.health())
        op = await p.scheduled(HealthProbe)
        warming = StageHealth(
            stage="worker", status="degraded", detail="warming up", warmup_done=12, warmup_total=140
        )
        await p.sched_out.send(HealthStatus(op_id=op.op_id, stages=[warming]))
        reply = await health
        assert not reply.ok
        (worker,) = [s for s in reply.stages if s.stage == "worker"]
        assert (worker.warmup_done, worker.warmup_total) == (12, 140)
        assert _stage(worker) == {
            "status": "degraded",
            "detail": "warming up",
            "warmup": {"done": 12, "total": 140},
        }
        assert "warmup" not in _stage(StageHealth(stage="worker", status="ok"))

    _run(tmp_path, model_dir, body)
