"""On a GPU: while a server warms up on an empty compile cache, the SDK's health() and HTTP /health
report the worker's warm-up progress (steps done of the total, never past it, never going back), and
once ready the progress is gone. Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from runtime.base.endpoints import free_port
from runtime.client import Client, LorapipeError
from tests.integration.serving import ROOT, wait_for_banner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
POLL_S = 0.1  # probe rate, not a synchronisation: each probe's answer is checked as it comes


def _http_health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 while not ready: the body says why
        return json.loads(e.read())
    except OSError:  # not listening yet
        return None


def test_health_reports_the_warm_up_while_it_runs(tiny_llama, tmp_path):
    port, hport = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "runtime.cli", "serve", "--model", str(tiny_llama), "--device", "cuda",
        "--endpoint", f"tcp://127.0.0.1:{port}", "--port", str(hport), "--metrics-port", "-1",
        "--compile-cache-dir", str(tmp_path / "cache"), "--max-lora-rank", "64",
        "--max-tokens-per-step", "256", "--max-running-requests", "32", "--lora-gpu-memory-gb", "0.05",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sdk, http = [], []
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=2.0) as client:
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    reply = client.health()
                except LorapipeError:
                    reply = None
                workers = [s for s in reply.stages if s.stage == "worker"] if reply is not None else []
                if workers:  # absent while the scheduler does not answer yet
                    sdk.append((reply.ok, workers[0].warmup_done, workers[0].warmup_total))
                    if reply.ok:
                        break
                body = _http_health(hport)
                if body is not None and "worker" in body.get("stages", {}):
                    http.append(body["stages"]["worker"])
                time.sleep(POLL_S)
        wait_for_banner(proc, 60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert sdk and sdk[-1][0], "never ready"
    warming = [(d, t) for ok, d, t in sdk if t]
    assert warming, "no probe saw the warm-up"
    assert all(0 <= d <= t for d, t in warming) and len({t for _, t in warming}) == 1
    assert [d for d, _ in warming] == sorted(d for d, _ in warming)
    assert sdk[-1][1:] == (0, 0)  # ready: no warm-up left
    seen = [w["warmup"] for w in http if "warmup" in w]
    assert seen and all(0 <= w["done"] <= w["total"] == warming[0][1] for w in seen)
