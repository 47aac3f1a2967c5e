"""A real `lorapipe serve` (CPU, tiny model) whose launcher is SIGKILLed while an OpenAI stream runs. The
stages run in sessions of their own and get their death signal when the launcher dies; the tokenizer
must then end that stream with an error event naming the cause and `[DONE]`, not cut it (or, for a
request whose answer had not begun, leave uvicorn to answer a bare 500: what a CI run of the Ray Serve
kill test caught), and every stage process must exit. The worker is stopped (SIGSTOP) before the
launcher is killed, so the stream cannot end on its own first. Stages that are stopped when their
launcher dies, so they can run no handler, are killed by their watchdogs: nothing of the server stays.
And a server that a Ray Serve replica started stops when the replica process dies."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from runtime.base.actor import WATCHDOG_GRACE_S
from tests.integration.hostile import descendants, live_descendants, wait_until
from tests.integration.serving import ROOT, serve

pytestmark = pytest.mark.timeout(300)

STAGES = ("loader", "worker", "scheduler", "tokenizer")
# argv: the model. A replica's part: start a server, print the launcher's pid and run dir, live on.
REPLICA = """
import asyncio, sys, time
from runtime.ray_serve.server_process import ServerProcess
server = ServerProcess.command(sys.argv[1], "cpu", "tiny", ("--num-pages", "256"))
asyncio.run(server.start(ready_timeout_s=120))
print(server.pid, server.run_dir, flush=True)
time.sleep(3600)
"""


def test_a_stream_running_when_the_launcher_dies_ends_with_an_error_event(tiny_llama):
    with serve(tiny_llama, {}, "--num-pages", "256", "--served-model-name", "tiny") as s:
        pids = {name: s.stage_pid(name) for name in STAGES}
        assert all(pids.values()), f"stage processes not found: {pids}"
        body = {
            "model": "tiny", "prompt": "The river carried the boat", "max_tokens": 480, "temperature": 0,
            "stream": True, "ignore_eos": True,
        }  # fmt: skip
        url = s.base_url + "/completions"
        with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            events = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
            first = json.loads(next(events))  # the stream is running
            assert first["choices"][0]["finish_reason"] is None
            # the worker stopped first, so the stream cannot finish before the tokenizer notices
            os.kill(pids["worker"], signal.SIGSTOP)
            try:
                os.kill(s.proc.pid, signal.SIGKILL)
                rest = list(events)
            finally:
                with contextlib.suppress(ProcessLookupError):  # its watchdog may have killed it
                    os.kill(pids["worker"], signal.SIGCONT)
    assert rest and rest[-1] == "[DONE]", f"the stream did not end properly: {rest[-3:]}"
    errors = [json.loads(e)["error"] for e in rest[:-1] if '"error"' in e]
    assert errors, f"no error event; the stream ended with {rest[-3:]}"
    assert "launcher died" in errors[0]["message"], errors[0]
    # what the Ray Serve replica reads as "retry elsewhere" when such an event comes first
    assert errors[0]["type"] == "service_unavailable", errors[0]
    wait_until(lambda: not live_descendants(list(pids.values())), "the stages to exit after their launcher")


def test_stages_stopped_when_the_launcher_dies_are_killed(tiny_llama):
    """The worker and the loader stopped (SIGSTOP) when the launcher is SIGKILLed: no handler of theirs
    can run, yet they, the other stages, every stage's watchdog and the loader's part writer are gone
    within a few seconds of the watchdogs' grace."""
    with serve(tiny_llama, {}, "--num-pages", "256", "--loader-writers", "1") as s:
        pids = {name: s.stage_pid(name) for name in STAGES}
        assert all(pids.values()), f"stage processes not found: {pids}"
        started = descendants(s.proc.pid)  # the stages, their watchdogs, the loader's part writer
        try:
            for stage in ("worker", "loader"):
                os.kill(pids[stage], signal.SIGSTOP)
            os.kill(s.proc.pid, signal.SIGKILL)
            wait_until(
                lambda: not live_descendants(started),
                "every process of the server to exit after its launcher",
                timeout=WATCHDOG_GRACE_S + 15,
            )
        finally:
            for line in live_descendants(started):  # never leave one behind, even stopped
                os.kill(int(line.split()[0]), signal.SIGKILL)


def test_a_replica_server_stops_when_its_replica_process_dies(tiny_llama):
    """`ServerProcess` names the replica process to the launcher it starts (the launcher arms its own
    death signal, SIGTERM): when the replica is SIGKILLed, the launcher drains, stops its stages and
    exits."""
    replica = subprocess.Popen(
        [sys.executable, "-c", REPLICA, str(tiny_llama)], cwd=ROOT, stdout=subprocess.PIPE
    )
    assert replica.stdout is not None
    line = replica.stdout.readline().split()
    started: list[int] = []
    try:
        assert len(line) == 2, f"the replica started no server ({replica.wait()})"
        launcher = int(line[0])
        started = [launcher, *descendants(launcher)]
        replica.kill()
        replica.wait()
        wait_until(lambda: not live_descendants(started), "the server to stop after its replica", timeout=60)
    finally:
        replica.kill()
        replica.wait()
        replica.stdout.close()
        for alive in live_descendants(started):  # never leave one behind
            os.kill(int(alive.split()[0]), signal.SIGKILL)
        if line:
            shutil.rmtree(line[-1].decode(), ignore_errors=True)
