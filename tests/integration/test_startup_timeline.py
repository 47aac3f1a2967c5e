"""A real `lorapipe serve` (CPU, tiny model) logs where every second of its start-up went: the launcher's
parts before the stages, the worker's parts from its process start to WorkerStarted on the wire (they add
up to its age then, on the launcher's clock), and each stage's Ready; the cold-start report turns the
log into one timeline from launch to the first health check that said ok."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

from benchmarks.cold_start_report import read_log, table, timeline
from runtime.base.endpoints import free_port
from runtime.client import Client, LorapipeError
from tests.integration.serving import ROOT, wait_for_banner

RUNNER_PARTS = [
    "runner init", "device init", "compile cache setup", "weights", "adapter pool", "KV cache", "graph setup",
    "warm-up",
]  # fmt: skip
WORKER_PARTS = [*RUNNER_PARTS, "graph capture"]
AFTER_RUNNER = ["host cache pinning", "executor", "rest of setup", "announce"]


def _ready_seconds(endpoint: str, since: float, deadline_s: float) -> float:
    """Seconds from `since` to the first health reply that says ok (probes as fast as they answer)."""
    with Client(endpoint, timeout=5.0) as client:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                if client.health().ok:
                    return time.time() - since
            except LorapipeError:
                pass
        raise AssertionError("never ready")


def start_up(model, adapters, tmp_path, device: str, *flags: str) -> tuple[dict, float]:
    """Start a server, time it to its first ok health reply, stop it; its log read by the report, and that
    time."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "runtime.cli", "serve", "--model", str(model), "--device", device,
        "--endpoint", f"tcp://127.0.0.1:{port}", "--metrics-port", "-1", "--port", "0",
        "--compile-cache-dir", str(tmp_path / "cache"), *flags,
    ]  # fmt: skip
    for name, path in adapters.items():
        cmd += ["--adapter", f"{name}={path}"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log_file:
        since = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file, text=True)
        try:
            ready_s = _ready_seconds(f"tcp://127.0.0.1:{port}", since, 600)
            wait_for_banner(proc, 60)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    log = read_log(log_path)
    assert log["worker_timeline"] is not None, log_path.read_text()
    return log, ready_s


def check_timeline(log: dict, ready_s: float, runner_parts: list[str]) -> list[tuple[str, float]]:
    """The worker's parts are the ones named, in order, and add up; the launcher's and the Ready come in
    order; the report's timeline adds up to `ready_s` with next to nothing unattributed. Returns it."""
    w = log["worker_timeline"]
    assert [n for n, _ in w["runner"]] == [*runner_parts, "rest of the runner"]
    assert [n for n, _ in w["after"]] == AFTER_RUNNER
    assert all(s >= 0 for _, s in w["runner"] + w["after"])
    # the worker's parts follow each other from its process start to WorkerStarted on the wire
    worker_total = w["before"] + w["config_wait"] + sum(s for _, s in w["runner"] + w["after"])
    assert abs(w["started"] + worker_total - w["sent"]) < 0.1, (w, worker_total)
    assert w["before"] > 0.3  # the interpreter and imports (torch's) are counted, not lost
    # the launcher's parts before the stages, and the order of the Ready that followed
    before_launcher = re.match(r"interpreter, imports, argument checks ([0-9.]+) s, ", log["launcher_parts"])
    assert before_launcher, log["launcher_parts"]
    # (each reading of /proc is good to a clock tick, 10 ms: the margins hold a few of them)
    # the worker's process started before the launcher had read and checked its arguments
    assert 0 <= w["started"] <= float(before_launcher[1]) + 0.02 <= log["spawned_s"] + 0.04
    assert w["sent"] <= min(log["worker_ready_s"], log["scheduler_ready_s"]) + 0.05
    assert log["scheduler_ready_s"] <= ready_s + 0.05
    parts = timeline(log, ready_s)
    assert abs(sum(s for _, s in parts) - ready_s) < 1e-9
    assert parts[-1][0] == "unattributed" and abs(parts[-1][1]) < 0.1
    row = {**log, "label": "server", "ready_s": ready_s, "timeline": parts}
    text = table({"servers": {"s": row}, "weights_read_s": None, "warmup_cli_s": None, "checks": []})
    assert "| worker: graph capture |" in text and "| unattributed |" in text
    return parts


def test_every_second_to_ready_is_attributed(tiny_llama, llama_adapters, tmp_path):
    log, ready_s = start_up(tiny_llama, llama_adapters, tmp_path, "cpu")
    check_timeline(log, ready_s, WORKER_PARTS)
