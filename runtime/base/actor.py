"""Actor base for stage processes: `run()` is one asyncio.TaskGroup of small loops (socket → bounded
mailbox → handler → bounded mailbox → socket) plus the control DEALER to the launcher (Ready, Shutdown,
MetricsQuery, FatalError), a parent-death watch and drain on SIGTERM/SIGINT. `serve()` runs it on uvloop;
`stage_main()` runs it as a stage process that dies with its launcher (`parent_death`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
import uvloop

from proto.base import PROTOCOL_VERSION
from proto.codec import ProtocolError
from proto.control import (
    Draining,
    FatalError,
    LauncherToStage,
    MergedMetrics,
    MergedMetricsQuery,
    MetricsQuery,
    MetricsReport,
    Ready,
    Shutdown,
    StageToLauncher,
)
from runtime.base import parent_death
from runtime.base.faults import FaultInjection
from runtime.base.gc_pauses import GcPauses
from runtime.base.metrics import StageMetrics
from runtime.base.sockets import DealerSocket, _Base

T = TypeVar("T")
_merged_ids = itertools.count(1)
C = TypeVar("C", bound="StageConfig")
EXIT_OK, EXIT_FATAL, EXIT_PARENT_DIED = 0, 1, 3
PARENT_DIED_GRACE_S = 2.0  # how long `on_parent_died` may take before the stage exits anyway
PARENT_DEATH_SIGNAL = signal.SIGHUP  # what the kernel sends a stage when its launcher dies (stage_main)
# after the launcher's death, how long a stage has to exit (on_parent_died, then teardown) before its
# watchdog SIGKILLs it: a stage hung in C or stopped runs no handler
WATCHDOG_GRACE_S = PARENT_DIED_GRACE_S + 3.0


class StageConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Fields every stage's frozen config carries; each stage subclasses it with its own."""

    control: str | None = None  # launcher ROUTER; None = run without a launcher (tests)
    drain_timeout_s: float = 10.0  # SIGTERM: give up draining after this long
    parent_poll_s: float = 0.25  # how quickly a dead launcher is noticed without its death signal
    queue_size: int = 1024  # default bound of every mailbox


class StageFatal(Exception):
    """Raised by a handler when the stage cannot go on: the actor reports FatalError and exits 1."""


class _Stop(Exception): ...


class _ParentDied(Exception): ...


class Mailbox(asyncio.Queue[T]):
    """A bounded, named stage queue: a full one blocks its producer (backpressure), it never grows."""

    def __init__(self, name: str, maxsize: int) -> None:
        if maxsize <= 0:
            raise ValueError(f"mailbox {name!r} needs a positive bound, got {maxsize}")
        super().__init__(maxsize)
        self.name = name


def _msg_of(item: Any) -> Any:
    return item[1] if isinstance(item, tuple) else item  # ROUTER items are (identity, msg)


class Actor(Generic[C]):
    """Subclasses set `stage`, implement `setup()` (sockets via `self.socket`, loops via `add_*`) and
    usually `drain()`; handlers `match` on message types and call `on_<message>` methods."""

    stage: ClassVar[str]

    def __init__(self, config: C) -> None:
        self.config = config
        self.log = logging.getLogger(f"lorapipe.{self.stage}")
        self.metrics = StageMetrics(self.stage)
        self.draining = False
        self.freeze_gc_after_setup = False  # stage_main's stages do (GcPauses.freeze); in-process ones not
        self._gc_pauses: GcPauses | None = None  # installed with the freeze
        self.parent_pid = os.getppid()  # stage_main sets the launcher's (the pid it was spawned by)
        self._parent_signal = asyncio.Event()  # PARENT_DEATH_SIGNAL arrived
        self._loops: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = []
        self._mailboxes: list[Mailbox[Any]] = []
        self._sockets: list[_Base[Any, Any]] = []
        self._inputs: list[_Base[Any, Any]] = []
        self._control: DealerSocket[Any, Any] | None = None
        self._stop_requested = asyncio.Event()
        self._stop_now = asyncio.Event()
        self.drain_timeout = config.drain_timeout_s  # Shutdown(deadline_s) may shorten it
        self.shutdown_reason = ""  # Shutdown(reason): why the pipeline is going down, if a stage failed
        self._merged_queries: dict[int, asyncio.Future[str]] = {}
        self.handler_failures = 0  # messages a handler raised on
        self._faults = FaultInjection.from_env(self.stage)

    # --- building blocks for subclasses -------------------------------------------------------------
    async def setup(self) -> None:
        raise NotImplementedError

    def mailbox(self, name: str, maxsize: int | None = None) -> Mailbox[Any]:
        box: Mailbox[Any] = Mailbox(name, maxsize or self.config.queue_size)
        self._mailboxes.append(box)
        self.metrics.track_queue(name, box.qsize, box.maxsize)
        return box

    def socket(self, sock: _Base[Any, Any]) -> Any:
        """Register a socket so it is closed (and its ipc file removed) when the actor exits."""
        self._sockets.append(sock)
        return sock

    def add_receiver(self, name: str, sock: Any, inbox: Mailbox[Any]) -> None:
        """sock.recv() → inbox; malformed messages go to on_malformed and are dropped."""
        self._inputs.append(sock)
        msgs_in = self.metrics.messages_in

        async def loop() -> None:
            while True:
                try:
                    item = await sock.recv()
                except ProtocolError as exc:
                    self.metrics.malformed.labels(socket=name).inc()
                    try:
                        await self.on_malformed(name, exc)
                    except Exception:  # answering a bad message must not stop the receiver
                        self.log.exception("on_malformed failed on %s", name)
                    continue
                msgs_in.labels(socket=name, type=type(_msg_of(item)).__name__).inc()
                await inbox.put(item)

        self._loops.append((f"recv:{name}", loop))

    def add_handler(self, name: str, inbox: Mailbox[Any], handle: Callable[[Any], Awaitable[None]]) -> None:
        """inbox → dispatch(handle, item), timed."""
        hist = self.metrics.service_seconds.labels(queue=inbox.name)

        async def loop() -> None:
            while True:
                item = await inbox.get()
                t0 = time.perf_counter()
                try:
                    await self.dispatch(name, handle, item)
                finally:
                    hist.observe(time.perf_counter() - t0)
                    inbox.task_done()

        self._loops.append((f"handle:{name}", loop))

    async def dispatch(self, name: str, handle: Callable[[Any], Awaitable[None]], item: Any) -> None:
        """handle(item); an exception is logged, counted and answered by `on_handler_failed` (the stage
        serves on, degraded); StageFatal and cancellation stop the stage."""
        try:
            self._faults.check(_msg_of(item))
            await handle(item)
        except (StageFatal, asyncio.CancelledError):
            raise
        except Exception as exc:
            self.metrics.handler_errors.labels(queue=name).inc()
            self.handler_failures += 1
            kind = type(_msg_of(item)).__name__
            self.log.exception("handler %s failed on %s", name, kind)
            try:
                await self.on_handler_failed(name, item, exc)
            except Exception:  # answering the failure must not stop the handler either
                self.log.exception("on_handler_failed failed on %s", kind)

    def add_sender(self, name: str, outbox: Mailbox[Any], send: Callable[[Any], Awaitable[None]]) -> None:
        """outbox → send(item) (e.g. `sock.send`, or a lambda unpacking (identity, msg) for a ROUTER)."""
        msgs_out = self.metrics.messages_out

        async def loop() -> None:
            while True:
                item = await outbox.get()
                try:
                    await send(item)
                    msgs_out.labels(socket=name, type=type(_msg_of(item)).__name__).inc()
                finally:
                    outbox.task_done()

        self._loops.append((f"send:{name}", loop))

    def add_loop(self, name: str, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._loops.append((name, fn))

    async def until_ready(self) -> None:
        """Returns once the stage can serve (its loops already run): Ready waits for it. Default: now."""

    async def on_handler_failed(self, queue: str, item: Any, exc: Exception) -> None:
        """A handler raised on `item` (logged, counted): fail what depended on it, typed, at once."""

    async def on_malformed(self, socket: str, exc: ProtocolError) -> None:
        self.log.warning("dropped a malformed message on %s: %s", socket, exc)

    async def drain(self) -> None:
        """Process what was delivered, flush what was produced (stages wait for their own work first)."""
        while True:
            for box in self._mailboxes:
                await box.join()
            if all(box.empty() for box in self._mailboxes) and not any(s.pending() for s in self._inputs):
                return
            await asyncio.sleep(0.001)  # let a receiver pick up what is pending

    async def on_parent_died(self) -> None:
        """The launcher is gone: the last chance (PARENT_DIED_GRACE_S) to tell clients. Default: none."""

    def request_drain(self) -> None:
        """SIGTERM/SIGINT/Shutdown: stop taking new work, exit once drained; a second call: at once."""
        if self._stop_requested.is_set():
            self._stop_now.set()
        self._stop_requested.set()

    # --- lifecycle -----------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        code = EXIT_OK
        try:
            if self.config.control:  # first, so that a failing setup() is still reported
                self._control = self.socket(
                    DealerSocket(
                        self.config.control, LauncherToStage, StageToLauncher, identity=self.stage.encode()
                    )
                )
            await self.setup()
            if self.freeze_gc_after_setup:  # what setup made lives as long as the process
                self._gc_pauses = GcPauses(self.metrics, self.log)
                self._gc_pauses.freeze()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_drain)
            loop.add_signal_handler(PARENT_DEATH_SIGNAL, self._parent_signal.set)  # its default ends us
            async with asyncio.TaskGroup() as tg:
                for name, fn in self._loops:
                    tg.create_task(fn(), name=f"{self.stage}:{name}")
                tg.create_task(self._watch_parent())
                tg.create_task(self._drain_then_stop())
                if self._control is not None:
                    tg.create_task(self._control_loop())
                    await self.until_ready()
                    await self._tell_launcher(
                        Ready(stage=self.stage, pid=os.getpid(), protocol_version=PROTOCOL_VERSION)
                    )
                self.log.info("ready (pid %d)%s", os.getpid(), self.ready_note())
        except* _Stop:
            code = EXIT_OK
        except* _ParentDied:
            self.log.error("parent process died; exiting")
            code = EXIT_PARENT_DIED
        except* Exception as group:
            self.log.error("stage failed", exc_info=group.exceptions[0])
            await self._tell_launcher(FatalError(stage=self.stage, message=repr(group.exceptions[0])))
            code = EXIT_FATAL
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, PARENT_DEATH_SIGNAL):
                loop.remove_signal_handler(sig)
            self.teardown()
            if self._gc_pauses is not None:
                self._gc_pauses.thaw()
        return code

    def ready_note(self) -> str:  # what the "ready" log line adds: where a user reaches the stage
        return ""

    def teardown(self) -> None:
        for sock in reversed(self._sockets):
            sock.close()

    async def _drain_then_stop(self) -> None:
        await self._stop_requested.wait()
        self.draining = True
        self.log.info("draining")
        await self._tell_launcher(Draining(stage=self.stage))
        drain = asyncio.ensure_future(self.drain())
        stop_now = asyncio.ensure_future(self._stop_now.wait())
        done, _ = await asyncio.wait(
            # a floor, so even a zero deadline leaves time to flush what drain() just produced
            {drain, stop_now},
            timeout=max(self.drain_timeout, 0.25),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if drain not in done:
            self.log.warning("drain did not finish; stopping anyway")
        for fut in (drain, stop_now):
            fut.cancel()
        await asyncio.gather(drain, stop_now, return_exceptions=True)
        raise _Stop

    async def _watch_parent(self) -> None:
        """Woken by PARENT_DEATH_SIGNAL, else every `parent_poll_s`. Only a reparenting says the parent is
        gone: the signal also comes as each of its threads exits before the last (the child moves to a
        thread still alive), or from anyone with `kill`."""
        while os.getppid() == self.parent_pid:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.parent_poll_s):
                    await self._parent_signal.wait()
            self._parent_signal.clear()
        try:
            async with asyncio.timeout(PARENT_DIED_GRACE_S):
                await self.on_parent_died()
        except TimeoutError:
            self.log.warning("telling clients of the launcher's death took over %gs", PARENT_DIED_GRACE_S)
        except Exception:  # the stage exits either way
            self.log.exception("on_parent_died failed")
        raise _ParentDied

    async def _control_loop(self) -> None:
        assert self._control is not None
        while True:
            try:
                msg = await self._control.recv()
            except ProtocolError as exc:
                await self.on_malformed("control", exc)
                continue
            match msg:
                case Shutdown(deadline_s=deadline, reason=reason):
                    self.drain_timeout = min(self.drain_timeout, deadline)
                    self.shutdown_reason = reason
                    self.request_drain()
                case MetricsQuery(query_id=qid):
                    text = self.metrics.exposition()
                    await self._control.send(MetricsReport(query_id=qid, stage=self.stage, text=text))
                case MergedMetrics(query_id=qid, text=text):
                    fut = self._merged_queries.get(qid)
                    if fut is not None and not fut.done():
                        fut.set_result(text)

    async def merged_metrics(self, timeout: float) -> str:
        """Every stage's metrics merged by the launcher (MergedMetricsQuery on the control channel); this
        stage's own exposition when it runs without a launcher. TimeoutError if no answer in time."""
        if self._control is None:
            return self.metrics.exposition()
        qid = next(_merged_ids)
        fut = self._merged_queries[qid] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._control.send(MergedMetricsQuery(query_id=qid))
                return await fut
        finally:
            del self._merged_queries[qid]

    async def _tell_launcher(self, msg: Any) -> None:
        """Best effort: a launcher that stopped reading must not wedge the stage."""
        if self._control is None or self._control.sock.closed:
            return
        try:
            async with asyncio.timeout(2.0):
                await self._control.send(msg)
        except TimeoutError:
            self.log.warning("launcher did not take %s", type(msg).__name__)


def serve(actor: Actor[Any]) -> int:
    """Run an actor on uvloop until it drains, fails or loses its parent; returns the exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {actor.stage} %(levelname)s %(message)s")
    return uvloop.run(actor.run())


def stage_main(
    make: Callable[[Any], Actor[Any]], config_type: type, argv: Sequence[str] | None = None
) -> None:
    """`python -m stages.X CONFIG.json`: decode the stage's frozen config (JSON, written by the
    launcher) and exit with the actor's code. The stage dies with its launcher (the pid in
    `parent_death.PARENT_PID_ENV`, else its parent now): the kernel sends it PARENT_DEATH_SIGNAL (its
    default action ends a stage still in setup; a running actor answers with `on_parent_died`), and a
    watchdog SIGKILLs it WATCHDOG_GRACE_S later if it is still there (hung, or stopped)."""
    parent = parent_death.spawner_pid() or os.getppid()
    if not parent_death.arm(PARENT_DEATH_SIGNAL, parent):
        sys.exit(EXIT_PARENT_DIED)  # the launcher died before the signal was armed
    watchdog = parent_death.start_watchdog(parent, WATCHDOG_GRACE_S)
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        if len(args) != 1:
            sys.exit(f"usage: python -m <stage> CONFIG.json (got {args})")
        with open(args[0], "rb") as f:
            config = msgspec.json.decode(f.read(), type=config_type)
        actor = make(config)
        actor.freeze_gc_after_setup = True
        actor.parent_pid = parent
        code = serve(actor)
    finally:
        if watchdog is not None:  # reaped here, not left to whoever inherits it
            watchdog.kill()
            watchdog.wait()
    sys.exit(code)
