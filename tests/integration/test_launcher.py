"""The launcher: `lorapipe serve` argument errors; start-up failures name the stage; a hung stage is
killed; the real pipeline restarts a killed loader, serves parseable per-stage metrics and leaves no
process, socket file, run dir or shared memory after SIGTERM; a killed worker fails in-flight requests."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from runtime.base.actor import StageConfig
from runtime.base.endpoints import Endpoints
from runtime.cli import main as cli_main
from runtime.client import Client, ServerError
from runtime.launcher import STAGES, Launcher, LaunchError
from runtime.serve_args import ServeArgs, ServeArgsError
from runtime.serve_checks import parse_serve_args, validate
from runtime.stage_configs import stage_configs

ROOT = Path(__file__).resolve().parents[2]
FAKE = "tests.integration.fake_stage"
FAKES = {"loader": FAKE, "worker": FAKE, "scheduler": FAKE}  # with the real tokenizer


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll a condition until it holds (returns its value) or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)
    return value


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(ppid: int) -> dict[int, str]:
    """pid → command line of the live children of `ppid`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == ppid:
            out[int(entry.name)] = cmd
    return out


def serve_args(model: Path, adapters: dict[str, Path] | None = None, **kw: Any) -> ServeArgs:
    kw.setdefault("endpoint", f"ipc://{model.parent}/client-{os.getpid()}.sock")
    kw.setdefault("metrics_port", -1)
    kw.setdefault("port", 0)  # no HTTP server
    return ServeArgs(
        model=str(model),
        adapters=tuple((n, str(p)) for n, p in (adapters or {}).items()),
        device="cpu",
        max_loras_per_batch=2,
        max_cpu_loras=3,
        max_lora_rank=16,
        num_pages=64,
        **kw,
    )


def assert_cleaned_up(pids: list[int], run_dir: Path, pool_name: str) -> None:
    assert not [p for p in pids if alive(p)], "a stage process outlived the launcher"
    assert not run_dir.exists(), f"run dir {run_dir} left behind"
    assert not pool_name or not Path("/dev/shm", pool_name).exists(), f"host pool {pool_name} left behind"


# --- arguments ----------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_serve_args_errors(tiny_llama, llama_adapters, tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    a, b = list(llama_adapters.items())[:2]
    cases = [
        (["--model", str(tmp_path / "nope")], "no such directory"),
        (["--model", str(gpt2)], "unsupported architecture 'GPT2LMHeadModel'"),
        (["--adapter", "noequals"], "expected NAME=PATH"),
        (["--adapter", f"bad name={a[1]}"], "name 'bad name'"),
        (["--adapter", f"x={a[1]}", "--adapter", f"x={b[1]}"], "--adapter x: the name is given twice"),
        (["--adapter", f"x={tmp_path}"], "no adapter_config.json"),
        (["--pin-adapter", "ghost"], "--pin-adapter ghost: no --adapter registers that name"),
        (["--lora-backend", "triton", "--device", "cpu"], "--lora-backend triton needs --device cuda"),
        (["--pointwise-backend", "triton", "--device", "cpu"], "--pointwise-backend triton needs --device"),
        (["--endpoint", "http://127.0.0.1:80"], "expected tcp://HOST:PORT or ipc:///PATH"),
        (["--max-loras-per-batch", "0"], "--max-loras-per-batch must be positive"),
        (["--max-plans-in-flight", "0"], "--max-plans-in-flight must be positive"),
        (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
        (["--prefetch-depth", "-1"], "--prefetch-depth must not be negative"),
        (["--cuda-graph-max-batch", "-2"], "--cuda-graph-max-batch must not be negative"),
        (["--port", "70000"], "--port 70000: not a port"),
        (["--served-model-name", "a:b"], "--served-model-name 'a:b'"),
    ]
    for flags, message in cases:
        argv = ["serve", *(["--model", str(tiny_llama)] if "--model" not in flags else []), *flags]
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        assert exc.value.code == 2, flags
        assert message in capsys.readouterr().err, flags


@pytest.mark.timeout(60)
def test_stage_configs_round_trip(tiny_llama, llama_adapters, tmp_path):
    args = serve_args(tiny_llama, llama_adapters, pinned_adapters=("qv5",), dtype="bfloat16")
    argv = ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "bfloat16", "--pin-adapter", "qv5"]
    argv += ["--max-loras-per-batch", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16"]
    argv += ["--num-pages", "64", "--endpoint", args.endpoint, "--metrics-port", "-1", "--port", "0"]
    for name, path in llama_adapters.items():
        argv += ["--adapter", f"{name}={path}"]
    assert parse_serve_args(argv) == args
    model_cfg = validate(args)
    endpoints = Endpoints.in_run_dir(tmp_path, client=args.endpoint)
    configs = stage_configs(args, model_cfg, endpoints, "pool-x", 4096)
    assert set(configs) == set(STAGES)
    for name, cfg in configs.items():
        decoded = msgspec.json.decode(msgspec.json.encode(cfg), type=type(cfg))
        assert decoded == cfg, name
        assert isinstance(cfg, StageConfig) and cfg.control == endpoints.control
    tok, sched, worker, loader = (configs[n] for n in ("tokenizer", "scheduler", "worker", "loader"))
    assert tok.adapters == tuple(llama_adapters) and tok.endpoints.client == args.endpoint
    assert sched.adapters == {n: str(p) for n, p in llama_adapters.items()}
    assert sched.policy.pinned_adapters == ("qv5",) and sched.policy.max_loras_per_batch == 2
    assert worker.runner.device == "cpu" and worker.runner.dtype == loader.dtype == "bfloat16"
    assert worker.host_pool_name == loader.host_pool_name == "pool-x"
    assert tok.max_model_len == sched.max_model_len == worker.max_model_len == min(512, 64 * 16)
    assert sched.policy.overlap_loading and worker.overlap_loading and sched.policy.prefetch_depth == 8
    off = parse_serve_args([*argv, "--no-overlap-loading", "--prefetch-depth", "0"])
    off_cfgs = stage_configs(off, model_cfg, endpoints, "pool-x", 4096)
    assert not off_cfgs["scheduler"].policy.overlap_loading and not off_cfgs["worker"].overlap_loading
    assert off_cfgs["scheduler"].policy.prefetch_depth == 0
    assert tok.http_port == 0 and tok.model_name == tiny_llama.name  # HTTP off; the directory's name
    http = stage_configs(
        parse_serve_args([*argv, "--port", "9123", "--host", "0.0.0.0", "--served-model-name", "org/m"]),
        model_cfg, endpoints, "pool-x", 4096,
    )["tokenizer"]  # fmt: skip
    assert (http.http_host, http.http_port, http.model_name) == ("0.0.0.0", 9123, "org/m")
    # decode graphs: never larger than the running batch; 0 turns them off
    assert worker.runner.cuda_graph_max_batch == 64 and worker.runner.max_model_len == worker.max_model_len
    for flags, want in ((["--max-running-requests", "300"], 256), (["--cuda-graph-max-batch", "0"], 0)):
        graphs = stage_configs(parse_serve_args([*argv, *flags]), model_cfg, endpoints, "pool-x", 4096)
        assert graphs["worker"].runner.cuda_graph_max_batch == want, flags


# --- failures with stand-in stages ------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "stage,behaviour,message",
    [("worker", "fatal", "stage 'worker' failed during start-up: RuntimeError"),
     ("loader", "exit:3", "stage 'loader' exited during start-up (exit code 3)")],
)  # fmt: skip
def test_startup_failure_names_the_stage(tiny_llama, monkeypatch, stage, behaviour, message):
    monkeypatch.setenv(f"LORAPIPE_FAKE_{stage.upper()}", behaviour)
    launcher = Launcher(serve_args(tiny_llama), stage_modules=FAKES)
    with pytest.raises(LaunchError, match=re.escape(message)):
        uvloop.run(launcher.start())
    assert launcher.failure and stage in launcher.failure
    assert_cleaned_up([s.pid for s in launcher.stages.values()], launcher.run_dir, launcher.pool_name)


@pytest.mark.timeout(60)
def test_ports_in_use_are_clear_start_up_errors(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (dict(endpoint=f"tcp://127.0.0.1:{port}"), f"--endpoint tcp://127.0.0.1:{port}: already in use"),
            (dict(metrics_port=port), f"--metrics-port {port}: already in use"),
        ]
        for kw, message in cases:  # refused before anything is made or spawned
            launcher = Launcher(serve_args(tiny_llama, **kw), stage_modules=FAKES)
            with pytest.raises(ServeArgsError, match=message):
                uvloop.run(launcher.start())
            assert not launcher.stages and launcher.run_dir is None and launcher.pool is None
            assert uvloop.run(Launcher(serve_args(tiny_llama, **kw), stage_modules=FAKES).run()) == 2


@pytest.mark.timeout(60)
def test_run_returns_nonzero_when_a_stage_fails(tiny_llama, monkeypatch):
    monkeypatch.setenv("LORAPIPE_FAKE_SCHEDULER", "fatal")
    launcher = Launcher(serve_args(tiny_llama), stage_modules=FAKES)
    assert uvloop.run(launcher.run()) == 1
    assert "stage 'scheduler' failed" in (launcher.failure or "")
    assert not [s.pid for s in launcher.stages.values() if alive(s.pid)]


@pytest.mark.timeout(60)
def test_a_hung_stage_is_killed(tiny_llama, monkeypatch):
    monkeypatch.setenv("LORAPIPE_FAKE_LOADER", "hang")
    launcher = Launcher(serve_args(tiny_llama, drain_timeout_s=0.2), stage_modules=FAKES)
    launcher.exit_grace_s = 0.5

    async def main() -> int:
        await launcher.start()
        launcher.request_stop()
        return await launcher.wait()

    t0 = time.monotonic()
    assert uvloop.run(main()) == 0
    assert time.monotonic() - t0 < 20
    assert launcher.stages["loader"].proc.returncode == -signal.SIGKILL
    assert all(s.proc.returncode == 0 for n, s in launcher.stages.items() if n != "loader")
    assert_cleaned_up([s.pid for s in launcher.stages.values()], launcher.run_dir, launcher.pool_name)


# --- the real pipeline ------------------------------------------------------------------------------
class Served:
    """`python -m runtime.cli serve` as a subprocess; ready once it prints its banner line."""

    def __init__(self, model: Path, adapters: dict[str, Path], log: Path, *flags: str) -> None:
        self.endpoint = f"ipc://{log.parent}/client.sock"
        cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", str(model), "--device", "cpu"]
        cmd += ["--endpoint", self.endpoint, "--metrics-port", "0", "--port", "0"]  # no HTTP front end
        cmd += ["--max-loras-per-batch", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16"]
        cmd += ["--num-pages", "128", *flags]
        for name, path in adapters.items():
            cmd += ["--adapter", f"{name}={path}"]
        self.log = log
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self.seen_pids: set[int] = set()
        try:
            self.banner = self._read_banner(120)
            fields = dict(f.split("=", 1) for f in self.banner.split() if "=" in f)
            self.metrics_url = fields["metrics"]
            self.pids = {name: int(fields[name]) for name in STAGES}
            self.seen_pids.update(self.pids.values())
            config = json.loads(Path(self.stage_cmd("loader").split()[-1]).read_text())
            self.run_dir = Path(config["endpoints"]["run_dir"])
            self.pool_name = config["host_pool_name"]
        except BaseException:
            self.close()
            raise

    def _read_banner(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=deadline - time.monotonic()):
                line = self.proc.stdout.readline()
                if line.startswith("lorapipe serving"):
                    return line
                assert line, f"launcher exited ({self.proc.wait()}): {self.log.read_text()[-3000:]}"
        raise AssertionError(f"no banner in {timeout}s: {self.log.read_text()[-3000:]}")

    def stage_cmd(self, stage: str) -> str:
        return children(self.proc.pid)[self.pids[stage]]

    def stage_pid(self, stage: str) -> int | None:
        found = [p for p, cmd in children(self.proc.pid).items() if f"stages.{stage} " in cmd]
        return found[0] if len(found) == 1 else None

    def close(self) -> None:
        """On the way out of a test, passed or failed: stop the launcher, never leave a stage behind."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.finish(30)

    def metrics(self) -> dict[tuple[str, str], float]:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        out: dict[tuple[str, str], float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = (s.name, s.labels.get("stage", ""))
                out[key] = out.get(key, 0.0) + s.value
        return out

    def finish(self, timeout: float = 60) -> int:
        """Wait for the launcher to exit; kill whatever is left after that."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            for pid in self.seen_pids:  # never leave a stage behind, even when the test failed
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_loader_restart_metrics_and_clean_sigterm(tiny_llama, llama_adapters, tmp_path):
    s = Served(tiny_llama, llama_adapters, tmp_path / "serve.log")
    try:
        metrics = s.metrics()
        for stage in STAGES:
            assert metrics[("lorapipe_stage_up", stage)] == 1.0
            assert ("lorapipe_queue_capacity", stage) in metrics  # every stage's own samples carry its label
        assert metrics[("lorapipe_stage_restarts_total", "loader")] == 0
        names = list(llama_adapters)
        with Client(s.endpoint, timeout=30) as client:
            assert client.generate("The river", names[0], max_tokens=4, ignore_eos=True).finish_reason
            old = s.pids["loader"]
            os.kill(old, signal.SIGKILL)
            new = wait_for(lambda: (p := s.stage_pid("loader")) != old and p, 30, "a new loader")
            s.seen_pids.add(new)
            wait_for(
                lambda: (
                    (m := s.metrics())[("lorapipe_stage_restarts_total", "loader")] == 1
                    and m[("lorapipe_stage_up", "loader")] == 1
                ),
                30,
                "the restarted loader to be ready",
            )
            for name in names[1:]:  # adapters the new loader has to read
                assert len(client.generate("A quiet", name, max_tokens=4, ignore_eos=True).token_ids) == 4
        assert s.proc.poll() is None
        everything = children(s.proc.pid)  # the stages, and the pool's resource tracker
        stages = {pid for pid, cmd in everything.items() if " -m stages." in cmd}
        assert stages == {new, s.pids["worker"], s.pids["scheduler"], s.pids["tokenizer"]}
        s.proc.send_signal(signal.SIGTERM)
        assert s.finish() == 0
    finally:
        s.close()
    wait_for(lambda: not any(alive(p) for p in everything), 10, "every child of the launcher to exit")
    assert_cleaned_up(list(s.seen_pids), s.run_dir, s.pool_name)
    assert not Path(s.endpoint[len("ipc://") :]).exists(), "client socket file left behind"
    assert "restarting stage 'loader'" in s.log.read_text()


@pytest.mark.timeout(120)
def test_worker_death_fails_in_flight_requests(tiny_llama, llama_adapters, tmp_path):
    s = Served(tiny_llama, llama_adapters, tmp_path / "serve.log")
    try:
        with Client(s.endpoint, timeout=30) as client:
            stream = client.stream(
                "Once upon a time", next(iter(llama_adapters)), max_tokens=400, ignore_eos=True
            )
            next(stream)  # the request is in flight
            os.kill(s.pids["worker"], signal.SIGKILL)
            with pytest.raises(ServerError, match="stage 'worker' died"):
                for _ in stream:
                    pass
        assert s.finish() == 1
    finally:
        s.close()
    assert_cleaned_up(list(s.seen_pids), s.run_dir, s.pool_name)
    assert "stage 'worker' died (killed by SIGKILL)" in s.log.read_text()
