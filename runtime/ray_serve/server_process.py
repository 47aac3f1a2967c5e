"""One replica's `lorapipe serve` as a child process group: the ZeroMQ endpoint in a private run
directory, the HTTP front end on a free loopback port, ready when the launcher prints its banner, stopped
with SIGTERM (drain) then SIGKILL. The launcher gets SIGTERM if the replica process dies first (Linux:
`runtime.base.parent_death`, armed by the launcher itself), and its stages die with it. Owns no sockets
itself; imports no Ray."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

from runtime.base.endpoints import free_port
from runtime.base.parent_death import PARENT_PID_ENV

ROOT = Path(__file__).resolve().parents[2]  # so `python -m runtime.cli` imports this tree from any cwd
BANNER = "lorapipe serving "  # the launcher's one line on stdout once every stage is ready


class ServerStartError(RuntimeError):
    """The server exited or did not become ready; the message says which and its exit code."""


def _drain(stream: IO[str]) -> None:
    with stream:
        for _ in stream:
            pass


class ServerProcess:
    """`start()` spawns and waits for the banner; `exit_code` is None while it runs; `stop()` drains."""

    def __init__(self, argv: list[str], run_dir: Path, endpoint: str, base_url: str) -> None:
        self.argv = argv
        self.run_dir = run_dir
        self.endpoint = endpoint  # the ZeroMQ client endpoint (ipc://, private to this replica)
        self.base_url = base_url  # http://127.0.0.1:PORT, the OpenAI-compatible front end
        self.proc: subprocess.Popen[str] | None = None

    @classmethod
    def command(
        cls, model: str, device: str, served_model_name: str, server_args: tuple[str, ...] = ()
    ) -> ServerProcess:
        run_dir = Path(tempfile.mkdtemp(prefix="lorapipe-replica-"))
        endpoint = f"ipc://{run_dir}/client.sock"
        port = free_port()
        argv = [
            sys.executable, "-m", "runtime.cli", "serve",
            f"--model={model}", f"--device={device}", f"--served-model-name={served_model_name}",
            f"--endpoint={endpoint}", "--metrics-port=-1", "--host=127.0.0.1", f"--port={port}",
            "--allow-any-adapter-path",  # the replica loads only the catalog's adapters
            *server_args,
        ]  # fmt: skip
        return cls(argv, run_dir, endpoint, f"http://127.0.0.1:{port}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    async def start(self, ready_timeout_s: float) -> None:
        """Spawn (from the calling thread, which the death signal is tied to) and wait for the banner;
        raises ServerStartError, the process group already stopped."""
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # its own process group (each stage has its own; see kill())
            # the launcher arms its death signal itself (`run_server`): a preexec_fn is not safe in a
            # process with threads, as a replica is
            env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
        )
        try:
            async with asyncio.timeout(ready_timeout_s):
                await asyncio.to_thread(self._read_banner)
        except TimeoutError:
            await self.stop(grace_s=5.0)
            raise ServerStartError(f"lorapipe serve was not ready within {ready_timeout_s:g}s") from None
        except ServerStartError:
            await self.stop(grace_s=5.0)
            raise

    def _read_banner(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(BANNER):  # read on to the end, so a later line can never fill the pipe
                threading.Thread(target=_drain, args=(self.proc.stdout,), daemon=True).start()
                return
        self.proc.stdout.close()
        code = self.proc.wait()
        raise ServerStartError(
            f"lorapipe serve exited with status {code} before it was ready (see its stderr)"
        )

    def kill(self) -> None:
        """SIGKILL the launcher's process group (what a crashed server looks like). The stages run in
        sessions of their own: each gets its death signal and exits, or is SIGKILLed by its watchdog a
        few seconds later if it is hung (`runtime.base.actor.stage_main`)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def stop(self, grace_s: float = 40.0) -> int | None:
        """SIGTERM the launcher (it drains and stops its stages), SIGKILL the group after `grace_s`."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.to_thread(proc.wait), grace_s)
                except TimeoutError:
                    self.kill()
                    await asyncio.to_thread(proc.wait)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything left in the launcher's group
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return None if proc is None else proc.returncode
