"""`lorapipe serve`: the launcher makes the private run dir and the shared-memory host pool, binds the
control ROUTER, spawns the four stages, waits for their Ready, supervises them (the loader restarts;
any other death takes the pipeline down), drains on SIGTERM/SIGINT and serves the merged `/metrics`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import msgspec
import uvloop

from proto.control import (
    Draining,
    FatalError,
    MergedMetricsQuery,
    ProtocolMismatch,
    Ready,
    Shutdown,
    check_ready,
)
from proto.tensor_parallel import STOP_RANKS_TIMEOUT_S
from runtime.base import parent_death
from runtime.base.endpoints import Endpoints, make_run_dir
from runtime.base.prestart import PrestartedWorker
from runtime.control_channel import ControlChannel, MetricsEndpoint
from runtime.host_cache_size import host_cache_bytes
from runtime.serve_args import ServeArgs, ServeArgsError
from runtime.serve_checks import validate
from runtime.stage_configs import compile_cache_dir, stage_configs
from runtime.supervisor import RestartBudget, StageProcess, describe_exit, log
from stages.worker.startup import Phases, process_age

STAGES = ("loader", "worker", "scheduler", "tokenizer")  # spawn order
SHUTDOWN_ORDER = ("tokenizer", "scheduler", "worker", "loader")  # the front stops taking requests first
RESTARTABLE = ("loader",)  # the scheduler retries its pending loads when a new loader says LoaderStarted
STAGE_DEADLINE_S = 5.0  # most Shutdown deadline of the stages behind the tokenizer
FAILURE_DEADLINE_S = 2.0  # deadlines when a stage died: nothing downstream will finish anyway
EXIT_GRACE_S = 3.0  # after a deadline, before SIGTERM (a stage's drain floor + socket linger)


class LaunchError(Exception):
    """The pipeline could not start; the message names the stage that failed."""


class _StopRequested(Exception):
    pass


class Launcher:
    """`await start()` spawns and waits for every stage's Ready, then supervises in the background;
    `await wait()` returns the exit code once the pipeline stopped (0: asked to; 1: a stage failed);
    `request_stop()` drains and stops it. `run()` does all of that under SIGTERM/SIGINT handlers."""

    def __init__(
        self,
        args: ServeArgs,
        *,
        stage_modules: Mapping[str, str] | None = None,
        model_cfg: Any = None,
        prestarted: PrestartedWorker | None = None,
    ) -> None:
        """`model_cfg`: what `validate(args)` returned, when the caller already checked the arguments.
        `prestarted`: the worker's process, started before them (`runtime.base.prestart`): it becomes
        the worker stage, or is killed with everything else if the start-up fails first."""
        self.args = args
        self.prestarted = prestarted
        self._model_cfg = model_cfg
        self.modules = {name: f"stages.{name}" for name in STAGES} | dict(stage_modules or {})
        self.stages: dict[str, StageProcess] = {}
        self.endpoints: Endpoints | None = None
        self.run_dir: Path | None = None
        self.failure: str | None = None  # why the pipeline went down, when a stage failed
        self.pool: Any = None  # the host cache's SharedMemory
        self.pool_name = ""
        self.control: ControlChannel | None = None
        self.metrics: MetricsEndpoint | None = None
        self._events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.exit_grace_s = EXIT_GRACE_S  # after a deadline, before each escalation (SIGTERM, SIGKILL)
        self._hurry = asyncio.Event()  # a second signal: stop waiting for drains
        self._stopping = False
        self._shutdown_done: asyncio.Future[None] | None = None
        self._supervisor: asyncio.Task[int] | None = None
        self._restarts = {name: RestartBudget() for name in RESTARTABLE}
        self._output: TextIO | None = None
        self.ready_at: dict[str, float | None] = {}  # each stage's Ready, seconds after launch

    # --- public ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Raises LaunchError (everything already torn down) if a stage fails before Ready."""
        try:
            await self._start()
        except BaseException as exc:
            if isinstance(exc, LaunchError):
                self.failure = str(exc)
            await self.shutdown(self.failure or "")
            raise
        self._supervisor = asyncio.ensure_future(self._supervise())

    async def wait(self) -> int:
        assert self._supervisor is not None, "start() first"
        return await self._supervisor

    def request_stop(self) -> None:
        """Drain and stop (idempotent); a second call stops waiting for drains."""
        if self._stopping:
            self._hurry.set()
        self._stopping = True
        self._events.put_nowait(("stop",))

    async def run(self) -> int:
        """start → supervise → shut down, with SIGTERM/SIGINT handlers; returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            try:
                await self.start()
            except _StopRequested:
                return 0
            except ServeArgsError as exc:  # the command line or the machine: one line, as argparse exits
                log.error("%s", exc)
                return 2
            except LaunchError as exc:
                log.error("%s", exc)
                return 1
            print(self.banner(), flush=True)
            return await self.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            self.close()

    async def __aenter__(self) -> Launcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.request_stop()
        with contextlib.suppress(Exception):
            await self.wait()
        self.close()

    @property
    def metrics_url(self) -> str | None:
        return self.metrics.url if self.metrics is not None else None

    def banner(self) -> str:
        """The one line `lorapipe serve` prints on stdout once every stage is ready."""
        assert self.endpoints is not None
        pids = " ".join(f"{n}={s.pid}" for n, s in self.stages.items())
        metrics = f" metrics={self.metrics_url}" if self.metrics_url else ""
        a = self.args
        host = f"[{a.host}]" if ":" in a.host else a.host
        http = f" http=http://{host}:{a.port}/v1" if a.port > 0 else ""
        return f"lorapipe serving endpoint={self.endpoints.client}{http}{metrics} pids: {pids}"

    def _live(self) -> list[str]:
        return [] if self._stopping else [n for n, s in self.stages.items() if s.alive and s.ready]

    # --- start-up -------------------------------------------------------------------------------------
    async def _start(self) -> None:
        args = self.args
        # the launcher's own part of the start-up, in the order it runs (the log line at spawn)
        steps = Phases()
        # before the launcher: the interpreter, the imports and the CLI's argument checks
        steps.add("interpreter, imports, argument checks", process_age() or 0.0)
        model_cfg = self._model_cfg or steps.run("checks", validate, args)
        mark = time.perf_counter()
        self.run_dir = make_run_dir()
        self.endpoints = Endpoints.in_run_dir(self.run_dir, client=args.endpoint)
        self.control = ControlChannel(self.endpoints.control, self._on_control)  # bound before any stage
        self.control.start()
        self.metrics = MetricsEndpoint(self.control, STAGES, self._live)
        if args.metrics_port >= 0:
            try:
                self.metrics.start(args.metrics_port)
            except OSError as exc:
                raise LaunchError(f"--metrics-port {args.metrics_port}: {exc}") from None
        steps.add("sockets", time.perf_counter() - mark)
        pool_name, pool_bytes = steps.run("host cache", self._init_pool, model_cfg)
        configs = steps.run("configs", stage_configs, args, model_cfg, self.endpoints, pool_name, pool_bytes)
        mark = time.perf_counter()
        if args.log_file:
            try:
                self._output = open(args.log_file, "a")  # noqa: SIM115 (closed in close())
            except OSError as exc:
                raise LaunchError(f"--log-file: {exc}") from None
        for name in STAGES:
            path = self.run_dir / f"{name}.json"
            path.touch(mode=0o600)  # the tokenizer's may hold the API key
            path.write_bytes(msgspec.json.encode(configs[name]))
            env = {"TRITON_CACHE_DIR": compile_cache_dir(args)} if name == "worker" else {}  # before import
            self.stages[name] = StageProcess(
                name, self.modules[name], path, self._on_exit, self._output, env=env
            )
        for name in STAGES:
            if name == "worker" and self.prestarted is not None:
                await self.stages[name].adopt(self.prestarted, args.log_file)
            else:
                await self.stages[name].start()
        steps.add("spawning", time.perf_counter() - mark)
        log.info("stages spawned %s after launch (%s)", _since_launch(), steps.line(2))
        await self._wait_ready()
        order = sorted(self.ready_at.items(), key=lambda kv: kv[1] if kv[1] is not None else float("inf"))
        log.info(
            "start-up: every stage ready %s after launch; each stage's Ready: %s",
            _since_launch(),
            ", ".join(f"{n} {'?' if t is None else f'{t:.2f} s'}" for n, t in order),
        )

    def _init_pool(self, model_cfg: Any) -> tuple[str, int]:
        from runtime.common.host_pool import create_pool

        nbytes = host_cache_bytes(self.args, model_cfg)
        try:
            self.pool = create_pool("lorapipe-", nbytes)
        except OSError as exc:
            raise LaunchError(f"could not create the {nbytes}-byte host cache: {exc}") from None
        self.pool_name = self.pool.name
        log.info("host cache: %s, %.1f MiB", self.pool_name, nbytes / 2**20)
        return self.pool_name, nbytes

    async def _wait_ready(self) -> None:
        pending = set(STAGES)
        try:
            async with asyncio.timeout(self.args.startup_timeout_s):
                while pending:
                    match await self._events.get():
                        case ("ready", stage):
                            pending.discard(stage)
                        case ("fatal", stage, message):
                            raise LaunchError(f"stage {stage!r} failed during start-up: {message}")
                        case ("exit", stage, _generation, code):
                            why = describe_exit(code)
                            raise LaunchError(f"stage {stage!r} exited during start-up ({why})")
                        case ("stop",):
                            raise _StopRequested
        except TimeoutError:
            names = ", ".join(repr(s) for s in sorted(pending))
            raise LaunchError(
                f"stage(s) {names} not ready after {self.args.startup_timeout_s:g}s (--startup-timeout)"
            ) from None

    # --- events ---------------------------------------------------------------------------------------
    def _on_control(self, stage: str, msg: Any) -> None:
        proc = self.stages.get(stage)
        match msg:
            case Ready():
                try:
                    check_ready(msg)
                except ProtocolMismatch as exc:
                    self._events.put_nowait(("fatal", stage, str(exc)))
                    return
                if proc is not None:
                    proc.ready = True
                self.ready_at.setdefault(stage, process_age())
                log.info("stage %r ready (pid %d) %s after launch", stage, msg.pid, _since_launch())
                self._events.put_nowait(("ready", stage))
            case FatalError(message=message):
                log.error("stage %r reported a fatal error: %s", stage, message)
                self._events.put_nowait(("fatal", stage, message))
            case Draining():
                log.info("stage %r draining", stage)
            case MergedMetricsQuery() if self.metrics is not None:
                self.metrics.answer_merged(stage, msg.query_id)

    def _on_exit(self, proc: StageProcess, generation: int, pid: int, code: int) -> None:
        level = logging.INFO if self._stopping and code == 0 else logging.WARNING
        log.log(level, "stage %r (pid %d) exited (%s)", proc.name, pid, describe_exit(code))
        if generation == proc.generation:
            proc.ready = False
        self._events.put_nowait(("exit", proc.name, generation, code))

    async def _supervise(self) -> int:
        reason = ""
        while not reason:
            match await self._events.get():
                case ("stop",):
                    break
                case ("fatal", stage, message) if stage not in RESTARTABLE:
                    reason = f"stage {stage!r} failed: {message}"
                case ("exit", stage, generation, code) if generation == self.stages[stage].generation:
                    if self._stopping:
                        continue
                    if stage not in RESTARTABLE:
                        reason = f"stage {stage!r} died ({describe_exit(code)})"
                    else:
                        reason = await self._restart(stage, code)
        if reason:
            self.failure = reason
            log.error("%s; shutting the pipeline down", reason)
        await self.shutdown(reason)
        return 1 if reason else 0

    async def _restart(self, stage: str, code: int) -> str:
        """Restart a stage with the same config; returns a failure reason when it keeps dying."""
        budget = self._restarts[stage]
        delay = budget.charge()
        if delay is None:
            n, window = budget.max_restarts + 1, budget.window_s
            return f"stage {stage!r} died {n} times in {window:g}s (last: {describe_exit(code)})"
        await asyncio.sleep(delay)  # backs off a crash loop; the first restart is immediate
        if self._stopping:
            return ""
        log.warning("restarting stage %r", stage)
        assert self.metrics is not None
        self.metrics.restarts.labels(stage=stage).inc()
        await self.stages[stage].start()
        return ""

    # --- shutdown -------------------------------------------------------------------------------------
    async def shutdown(self, reason: str = "") -> None:
        """Stop every stage in SHUTDOWN_ORDER (Shutdown, then SIGTERM, then SIGKILL) and clean up.
        With a `reason` (a stage failed) the tokenizer fails open requests at once, naming it."""
        if self._shutdown_done is not None:
            await asyncio.shield(self._shutdown_done)
            return
        self._shutdown_done = asyncio.get_running_loop().create_future()
        self._stopping = True
        try:
            for name in SHUTDOWN_ORDER:
                proc = self.stages.get(name)
                if proc is None or not proc.alive:
                    continue
                drain = self.args.drain_timeout_s
                deadline = drain if name == "tokenizer" else min(drain, STAGE_DEADLINE_S)
                deadline = min(deadline, FAILURE_DEADLINE_S) if reason else deadline
                tp_s = STOP_RANKS_TIMEOUT_S if name == "worker" and self.args.tensor_parallel_size > 1 else 0
                await self._stop_stage(proc, Shutdown(deadline_s=deadline, reason=reason), deadline + tp_s)
        finally:
            self.close()
            self._shutdown_done.set_result(None)

    async def _stop_stage(self, proc: StageProcess, msg: Shutdown, deadline: float) -> None:
        sent = proc.ready and self.control is not None and await self.control.send(proc.name, msg)
        if not sent:
            proc.signal(signal.SIGTERM)  # the actor drains on SIGTERM as on Shutdown
        if not await proc.wait_exit(deadline + self.exit_grace_s, self._hurry):
            await proc.terminate(self.exit_grace_s, self._hurry)

    def close(self) -> None:
        """Synchronous, idempotent cleanup: no child, socket file, run dir or shared memory left."""
        for proc in self.stages.values():
            proc.kill_now()
        if self.prestarted is not None and not self.prestarted.adopted:
            self.prestarted.kill()
        if self.metrics is not None:
            self.metrics.close()
        if self.control is not None:
            self.control.close()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        client = self.endpoints.client if self.endpoints is not None else ""
        with contextlib.suppress(OSError):  # a killed tokenizer could not remove its socket file
            if client.startswith("ipc://") and stat.S_ISSOCK(os.stat(client[6:]).st_mode):
                os.unlink(client[6:])
        if self.pool is not None:
            from runtime.common.host_pool import stop_resource_tracker, unlink_pool

            unlink_pool(self.pool)
            self.pool = None
            stop_resource_tracker()  # nothing of ours outlives the launcher, the tracker included
        if self._output is not None:
            self._output.close()
            self._output = None


def _since_launch() -> str:
    """The launcher process's age (interpreter and imports included), for the start-up's log lines."""
    age = process_age()
    return "?" if age is None else f"{age:.2f} s"


def run_server(
    args: ServeArgs,
    stage_modules: Mapping[str, str] | None = None,
    model_cfg: Any = None,
    prestarted: PrestartedWorker | None = None,
) -> int:
    """`lorapipe serve`: run a Launcher on uvloop in this process until it stops; the exit code (2: the
    arguments could not be served, 1: a stage failed). `prestarted`: see Launcher."""
    fmt = "%(asctime)s launcher %(levelname)s %(message)s"
    logging.basicConfig(level=args.log_level.upper(), format=fmt, stream=sys.stderr)
    spawner = parent_death.spawner_pid()  # a Ray Serve replica's (runtime/ray_serve/server_process.py)
    if spawner is not None and not parent_death.arm(signal.SIGTERM, spawner):  # SIGTERM: drain and stop
        log.error("the process that started this server (pid %d) is gone", spawner)
        return 1
    launcher = Launcher(args, stage_modules=stage_modules, model_cfg=model_cfg, prestarted=prestarted)
    return uvloop.run(launcher.run())
