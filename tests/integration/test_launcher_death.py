"""A real `lorapipe serve` (CPU, tiny model) whose launcher is SIGKILLed while an OpenAI stream runs. The
stages run in sessions of their own and notice the launcher's death within `parent_poll_s`; the
tokenizer must then end that stream with an error event naming the cause and `[DONE]`, not cut it (or,
for a request whose answer had not begun, leave uvicorn to answer a bare 500: what a CI run of the Ray
Serve kill test caught), and every stage process must exit. The worker is stopped (SIGSTOP) before the
launcher is killed, so the stream cannot end on its own first."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from tests.integration.hostile import live_descendants, wait_until
from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(300)

STAGES = ("loader", "worker", "scheduler", "tokenizer")


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
                os.kill(pids["worker"], signal.SIGCONT)
    assert rest and rest[-1] == "[DONE]", f"the stream did not end properly: {rest[-3:]}"
    errors = [json.loads(e)["error"] for e in rest[:-1] if '"error"' in e]
    assert errors, f"no error event; the stream ended with {rest[-3:]}"
    assert "launcher died" in errors[0]["message"], errors[0]
    # what the Ray Serve replica reads as "retry elsewhere" when such an event comes first
    assert errors[0]["type"] == "service_unavailable", errors[0]
    wait_until(lambda: not live_descendants(list(pids.values())), "the stages to exit after their launcher")
