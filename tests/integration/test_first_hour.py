"""The README followed as a newcomer follows it, on the CPU: the demo, then the `serve` command the demo
and the README give, every SDK, HTTP, OpenAI and offline example of the README run unchanged against it
(only the demo directory and the ports differ: tests never take fixed ports), and a shutdown whose log is
the stages' own lines, nothing else."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import urllib.request

import pytest

from runtime.base.endpoints import free_port
from tests.integration.serving import ROOT, wait_for_banner

pytestmark = pytest.mark.timeout(240)

README = (ROOT / "README.md").read_text()
DEMO = ".cache/lorapipe-demo"
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _block(lang: str, needle: str) -> str:
    (found,) = [b for b in _blocks(lang) if needle in b]
    return found


def _readme_serve_argv() -> list[str]:
    block = _block("bash", f"lorapipe serve --model {DEMO}/model")
    return shlex.split(block.replace("\\\n", " "))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`lorapipe demo` in a fresh directory: its printout and the directory."""
    root = tmp_path_factory.mktemp("first-hour") / "demo"
    out = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "demo", "--dir", str(root)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, root


def test_the_readme_says_how_to_reach_lorapipe_after_the_quickstart():
    """The quickstart installs into .venv, which is not on PATH: the README and the script both say to
    activate it, and the README that `serve` holds its terminal."""
    quickstart = _block("bash", "tools/quickstart.sh demo")
    assert "source .venv/bin/activate" in quickstart
    assert "holds its terminal" in README
    assert "source $venv/bin/activate" in (ROOT / "tools" / "quickstart.sh").read_text()


def test_the_demo_ends_with_its_table_and_the_readme_serve_command(demo):
    stdout, root = demo
    lines = stdout.rstrip("\n").splitlines()
    assert len(lines) < 25, stdout  # the table and a few lines, no pages of internal counters
    assert not [line for line in lines if re.search(r"\w+_(total|seconds|bytes)\b", line)], stdout
    assert "6/6 requests completed" in stdout
    hint = shlex.split(lines[-1])
    assert hint == [a.replace(DEMO, str(root)) for a in _readme_serve_argv()]


def test_readme_examples_run_against_the_demo_server(demo, tmp_path):
    _, root = demo
    port, http = free_port(), free_port()
    argv = [a.replace(DEMO, str(root)) for a in _readme_serve_argv()]
    assert argv[0] == "lorapipe"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "runtime.cli", *argv[1:]]
    cmd += ["--endpoint", f"tcp://127.0.0.1:{port}", "--port", str(http), "--metrics-port", "-1"]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        banner = wait_for_banner(proc, 120)
        assert f" http=http://127.0.0.1:{http}/v1 " in banner, banner  # the ready line gives the HTTP URL
        assert f"OpenAI-compatible HTTP at http://127.0.0.1:{http}/v1" in log.read_text()

        def local(code: str) -> str:
            code = code.replace(DEMO, str(root)).replace("127.0.0.1:7450", f"127.0.0.1:{port}")
            return code.replace("127.0.0.1:8000", f"127.0.0.1:{http}")

        exec(compile(local(_block("python", "from runtime.client import Client")), "README SDK", "exec"), {})
        exec(compile(local(_block("python", "from openai import OpenAI")), "README OpenAI", "exec"), {})
        exec(
            compile(local(_block("python", "from runtime.offline import LLM")), "README offline", "exec"), {}
        )
        curls = _block("bash", "curl -s").replace("\\\n", " ").strip().splitlines()
        assert len(curls) == 3
        for line in curls:
            words = shlex.split(line)
            url = "http://" + words[words.index("curl") + 2 if words[1].startswith("-") else 1]
            url = local(url.replace("localhost:8000", "127.0.0.1:8000"))
            body = local(words[words.index("-d") + 1]).encode()
            req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200 and resp.read(), line
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 0
    # every log line on a line of its own, and no extension's leak report at exit glued among them
    text = log.read_text()
    assert "nanobind" not in text, text[-3000:]
    assert "exited (exit code 0)" in text  # the shutdown was logged
    for line in text.splitlines():
        assert not LOG_LINE.search(line, 1), f"a log line glued onto another: {line}"
