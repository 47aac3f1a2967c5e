"""`lorapipe serve` start-up errors: one line and exit status 2, before any stage starts. Adapters given
with --adapter are read with the loader's code and refused with a runtime load's message; a busy client
or metrics port is refused by a real `lorapipe serve` process; `--help` shows every flag's default."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.cli import main as cli_main
from runtime.offline import LLM
from runtime.serve_args import HelpFormatter, add_serve_arguments
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import make_model
from stages.loader.adapter_config import AdapterError

ROOT = Path(__file__).resolve().parents[2]


def _runtime_load_error(model: Path, adapter: Path, max_rank: int) -> str:
    """The message a runtime load of this adapter gives (the offline engine's add_adapter)."""
    llm = LLM(model, device="cpu", max_lora_rank=max_rank, num_pages=8)
    with pytest.raises(AdapterError) as exc:
        llm.add_adapter("x", adapter)
    return str(exc.value)


@pytest.mark.timeout(120)
def test_bad_adapters_stop_the_start_with_a_runtime_loads_message(tiny_llama, tmp_path, capsys):
    other = make_model(tmp_path / "wider", preset="tiny", seed=4, overrides={"hidden_size": 96})
    (wrong_base,) = make_adapters(other, tmp_path / "wrong", n=1, ranks=(4,), seed=1)
    (too_big,) = make_adapters(tiny_llama, tmp_path / "big", n=1, ranks=(32,), seed=2)
    (good,) = make_adapters(tiny_llama, tmp_path / "good", n=1, ranks=(8,), seed=3)
    for adapter, flags in ((wrong_base, []), (too_big, ["--max-lora-rank", "16"])):
        want = _runtime_load_error(tiny_llama, adapter, 16)
        argv = ["serve", "--model", str(tiny_llama), "--device", "cpu", "--metrics-port", "-1", "--port", "0"]
        argv += flags
        argv += ["--adapter", f"ok={good}", "--adapter", f"x={adapter}"]
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert err.count("\n") == 1, err  # one line, no usage block, no traceback
        assert err.startswith(f"lorapipe serve: error: --adapter x={adapter}: ") and want in err, (err, want)
    assert "made for another model?" in _runtime_load_error(tiny_llama, wrong_base, 16)
    assert "rank 32 exceeds max_lora_rank 16" in _runtime_load_error(tiny_llama, too_big, 16)


def _serve(model: Path, *flags: str) -> subprocess.CompletedProcess:
    """`lorapipe serve` with the HTTP front end off (the default port 8000 may be another program's)."""
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", str(model), "--device", "cpu"]
    cmd += ["--port", "0", *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(150)
def test_a_busy_port_is_one_line_and_exit_2(tiny_llama):
    with socket.socket() as other:  # another program listening on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        res = _serve(tiny_llama, "--endpoint", f"tcp://127.0.0.1:{port}", "--metrics-port", "-1")
        assert res.returncode == 2, res.stderr
        assert res.stderr == f"lorapipe serve: error: --endpoint tcp://127.0.0.1:{port}: already in use " \
            "(another server on that port?)\n"  # fmt: skip
        res = _serve(tiny_llama, "--endpoint", "tcp://127.0.0.1:0", "--metrics-port", str(port))
        assert res.returncode == 2, res.stderr
        assert res.stderr == f"lorapipe serve: error: --metrics-port {port}: already in use " \
            "(another server on that port?)\n"  # fmt: skip


def test_help_shows_every_flag_with_a_default_in_groups():
    parser = argparse.ArgumentParser(prog="lorapipe serve", formatter_class=HelpFormatter)
    add_serve_arguments(parser)
    titles = [g.title for g in parser._action_groups[2:]]
    groups = ["model", "adapters", "memory", "batching", "loading", "endpoints", "start-up and logs"]
    assert titles == [*groups, "security and limits"]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest in ("help", "model"):  # --model is required: it has no default
            continue
        text = formatter._get_help_string(action)
        assert text and "default" in text, action.option_strings
    text = parser.format_help()
    assert "(default: 64)" in text and "(default: tcp://127.0.0.1:7450)" in text
