"""Runs `lorapipe serve` as a real subprocess for integration tests: free loopback ports, readiness
by polling health with a deadline, SIGTERM on exit, and the metrics endpoint parsed into numbers."""

from __future__ import annotations

import contextlib
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from runtime.base.endpoints import free_port
from runtime.client import Client
from runtime.ray_serve.server_process import BANNER

ROOT = Path(__file__).resolve().parents[2]


def stage_up(metrics: dict[tuple[str, str, tuple], float], stage: str) -> float | None:
    """`lorapipe_stage_up` of `stage` in a `Server.metrics()` scrape: 1 answered, 0 did not, None no such
    stage process."""
    return metrics.get(("lorapipe_stage_up", stage, (("stage", stage),)))


# the families `Server.snapshot` shows: requests by queue and tier, adapters by tier, the scheduler's
# holds, the loader's cache, the stages' queues and whether each stage answered
SNAPSHOT_FAMILIES = frozenset(
    {
        "lorapipe_stage_up",
        "lorapipe_waiting_requests",
        "lorapipe_running_requests",
        "lorapipe_waiting_requests_by_tier",
        "lorapipe_adapters_by_tier",
        "lorapipe_host_holds",
        "lorapipe_host_cache_adapters",
        "lorapipe_lora_pool_adapters",
        "lorapipe_slot_refs",
        "lorapipe_kv_pages_used",
        "lorapipe_queue_depth",
        "lorapipe_plans",
        "lorapipe_adapter_loads",
        "lorapipe_slot_loads",
        "lorapipe_requests_failed",
    }
)


class Server:
    def __init__(
        self,
        proc: subprocess.Popen,
        endpoint: str,
        metrics_port: int,
        http_port: int = 0,
        api_key: str | None = None,
    ):
        self.proc, self.endpoint, self.metrics_port = proc, endpoint, metrics_port
        self.http_port = http_port
        self.api_key = api_key

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API's base URL (what `openai.OpenAI(base_url=...)` takes)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def stage_pid(self, stage: str) -> int | None:
        """The pid of the launcher's child running `python -m stages.<stage>` (None if there is none)."""
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and f"stages.{stage}".encode() in cmd:
                return int(proc.name)
        return None

    def client(self, timeout: float = 60.0) -> Client:
        return Client(self.endpoint, timeout=timeout, api_key=self.api_key)

    def metrics(self) -> dict[tuple[str, str], float]:
        """{(sample name, stage): value} for unlabeled-but-stage samples."""
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, s.labels.get("stage", ""), tuple(sorted(s.labels.items())))] = s.value
        return out

    def answered(self, stage: str, timeout: float = 30.0) -> dict[tuple[str, str, tuple], float]:
        """`metrics()` from a scrape that `stage` answered. The launcher waits a second for each stage
        (`SCRAPE_TIMEOUT_S`); one that answers later shows up as `lorapipe_stage_up 0` with no samples of
        its own, which a test must not read as zeros (a busy or cold stage, e.g. on its first scrape).
        Scrapes again until the stage answered; fails if it does not within `timeout`. A label that names
        no stage process (no `lorapipe_stage_up` sample) is read from the first scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            up = stage_up(m, stage)
            if up is None or up == 1.0:
                return m
            assert time.monotonic() < deadline, f"stage {stage!r} answered no metrics scrape in {timeout} s"

    def snapshot(self) -> str:
        """Where requests and adapters are now, one `name{labels} value` line each: what a test prints
        when the server did not answer in time, so that the report shows what it was waiting on."""
        try:
            m = self.metrics()
        except OSError as exc:
            return f"(no metrics scrape: {exc})"
        lines = [
            f"{n}{{{', '.join(f'{k}={v}' for k, v in lab)}}} {v:g}"
            for (n, _, lab), v in sorted(m.items())
            if n.removesuffix("_total") in SNAPSHOT_FAMILIES
        ]
        return "\n".join(lines)

    def metric(self, name: str, stage: str) -> float:
        return sum(v for (n, st, _), v in self.answered(stage).items() if n == name and st == stage)

    def metric_labeled(self, name: str, stage: str, **labels: str) -> float:
        return sum(
            v
            for (n, st, lab), v in self.answered(stage).items()
            if n == name and st == stage and labels.items() <= dict(lab).items()
        )


def wait_for_banner(proc: subprocess.Popen, timeout: float) -> str:
    """The launcher's one line on stdout, printed once every stage is ready (a client polling health
    would spin: a server not listening yet refuses at once)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "server not ready in time"
            if sel.select(left):
                line = proc.stdout.readline()
                if line.startswith(BANNER):
                    return line
                assert line, f"server exited with {proc.wait()} before it was ready"


@contextlib.contextmanager
def serve(
    model: Path,
    adapters: dict[str, Path],
    *flags: str,
    ready_timeout: float = 120.0,
    api_key: str | None = None,
) -> Iterator[Server]:
    port, mport, hport = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "runtime.cli",
        "serve",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--metrics-port",
        str(mport),
        "--port",
        str(hport),
        *flags,
    ]
    for name, path in adapters.items():
        cmd += ["--adapter", f"{name}={path}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server = Server(proc, f"tcp://127.0.0.1:{port}", mport, hport, api_key)
    try:
        wait_for_banner(proc, ready_timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
