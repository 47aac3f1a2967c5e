"""The launcher's control channel: the ROUTER every stage's DEALER connects to (Ready, FatalError,
Draining in; Shutdown, MetricsQuery out), and `/metrics`, which scrapes the live stages through it and
merges their texts with the launcher's own counters (runtime.base.metrics.serve_metrics)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import zmq
from prometheus_client import CollectorRegistry, Counter, generate_latest

from proto.codec import ProtocolError
from proto.control import LauncherToStage, MergedMetrics, MetricsQuery, MetricsReport, StageToLauncher
from runtime.base.metrics import merge_expositions, serve_metrics
from runtime.base.sockets import PeerGone, RouterSocket

log = logging.getLogger("lorapipe.launcher")
SCRAPE_TIMEOUT_S = 1.0  # a stage that does not answer a scrape this fast shows up 0


class ControlChannel:
    """The control ROUTER (bound by the launcher before any stage starts). Messages other than metrics
    reports go to `on_message(stage, msg)`; `query_metrics` gathers MetricsReports with a deadline."""

    def __init__(self, addr: str, on_message: Callable[[str, Any], None]) -> None:
        self.sock: RouterSocket[Any, Any] = RouterSocket(addr, StageToLauncher, LauncherToStage)
        # a restarted stage reconnects with the same identity before the old connection is reaped
        self.sock.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.on_message = on_message
        self._query_ids = itertools.count(1)
        self._reports: dict[tuple[int, str], asyncio.Future[str]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            try:
                identity, msg = await self.sock.recv()
            except ProtocolError as exc:
                log.warning("dropped a malformed control message: %s", exc)
                continue
            stage = identity.decode(errors="replace")
            if isinstance(msg, MetricsReport):
                fut = self._reports.get((msg.query_id, stage))
                if fut is not None and not fut.done():
                    fut.set_result(msg.text)
                continue
            self.on_message(stage, msg)

    async def send(self, stage: str, msg: Any) -> bool:
        """False when the stage is not connected (or not reading): the caller falls back to signals."""
        try:
            await self.sock.send(stage.encode(), msg)
        except PeerGone:  # PeerBusy included
            return False
        return True

    async def query_metrics(self, stages: Iterable[str], timeout: float) -> dict[str, str | None]:
        """Each stage's exposition text, or None for one that did not answer within `timeout`."""
        qid = next(self._query_ids)
        loop = asyncio.get_running_loop()
        futs: dict[str, asyncio.Future[str]] = {}
        for stage in stages:
            fut = self._reports[(qid, stage)] = loop.create_future()
            futs[stage] = fut
            if not await self.send(stage, MetricsQuery(query_id=qid)):
                fut.cancel()
        try:
            if futs:
                await asyncio.wait(futs.values(), timeout=timeout)
        finally:
            for stage in futs:
                self._reports.pop((qid, stage), None)
        return {s: f.result() if f.done() and not f.cancelled() else None for s, f in futs.items()}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for fut in self._reports.values():
            fut.cancel()
        self.sock.close()


class MetricsEndpoint:
    """`http://127.0.0.1:PORT/metrics`. `live()` names the stages to ask (others show up 0); the
    scrape runs on the event loop, called from the HTTP server's thread."""

    def __init__(self, control: ControlChannel, stages: Iterable[str], live: Callable[[], list[str]]) -> None:
        self.control = control
        self.stages = list(stages)
        self.live = live
        self.url: str | None = None
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "lorapipe_stage_restarts", "Stages restarted", ["stage"], registry=self.registry
        )
        for stage in self.stages:
            self.restarts.labels(stage=stage)
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._answers: set[asyncio.Task[None]] = set()

    def start(self, port: int) -> str:
        """Bind (port 0: any free one) and serve from a thread; returns the URL."""
        self._loop = asyncio.get_running_loop()
        self._server, _thread = serve_metrics(port, self._fetch)
        self.url = f"http://127.0.0.1:{self._server.server_port}/metrics"
        return self.url

    async def scrape(self) -> dict[str, str | None]:
        """Every stage's exposition text (None: not running or not answering), and the launcher's."""
        texts: dict[str, str | None] = dict.fromkeys(self.stages)
        texts.update(await self.control.query_metrics(self.live(), SCRAPE_TIMEOUT_S))
        texts["launcher"] = generate_latest(self.registry).decode()
        return texts

    def answer_merged(self, stage: str, query_id: int) -> None:
        """A stage (the tokenizer, for its HTTP /metrics) asked for the merged text: scrape and answer."""

        async def answer() -> None:
            text = merge_expositions(await self.scrape()).decode()
            await self.control.send(stage, MergedMetrics(query_id=query_id, text=text))

        task = asyncio.ensure_future(answer())
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    def _fetch(self) -> dict[str, str | None]:
        assert self._loop is not None
        try:
            fut = asyncio.run_coroutine_threadsafe(self.scrape(), self._loop)
            return fut.result(SCRAPE_TIMEOUT_S + 2.0)
        except Exception as exc:  # never fail the scrape: every stage shows up 0
            log.warning("metrics scrape failed: %r", exc)
            return dict.fromkeys(self.stages)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
