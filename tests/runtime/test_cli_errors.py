"""What a mistyped `lorapipe` command line prints: one line naming the command, the flag and the
problem, with where help is; never argparse's usage block, and never a path twice."""

from __future__ import annotations

import pytest

from runtime.cli import main as cli_main
from tests.conftest import NO_FIXED_PORTS


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and "usage:" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ([], "lorapipe serve: error: the following arguments are required: --model"),
        (["--model", "M", "--max-running-requests", "x"], "argument --max-running-requests: invalid int"),
        (["--model", "M", "--frobnicate"], "lorapipe serve: error: unrecognized arguments: --frobnicate"),
    ],
)
def test_a_bad_serve_flag_is_one_line_from_serve(capsys, flags, want):
    line = _error(capsys, ["serve", *flags])
    assert want in line and "lorapipe serve --help" in line


def test_an_unknown_command_is_one_line(capsys):
    assert "invalid choice: 'frob'" in _error(capsys, ["frob"])


def test_a_missing_adapter_directory_is_called_that(capsys, tiny_llama, tmp_path):
    gone = tmp_path / "no" / "such" / "dir"
    line = _error(capsys, ["serve", "--model", str(tiny_llama), *NO_FIXED_PORTS, "--adapter", f"x={gone}"])
    assert line == f"lorapipe serve: error: --adapter x={gone}: no such directory"
    line = _error(
        capsys, ["serve", "--model", str(tiny_llama), *NO_FIXED_PORTS, "--adapter", f"x={tmp_path}"]
    )
    assert line.endswith(": no adapter_config.json (not a PEFT adapter directory)")


def test_an_adapter_given_as_the_model_says_so_once(capsys, llama_adapters):
    path = str(llama_adapters["full8"])
    line = _error(capsys, ["serve", "--model", path, *NO_FIXED_PORTS])
    assert line.count(path) == 1, line
    assert "no config.json" in line and "--adapter NAME=DIR" in line


def test_warmup_takes_the_serve_flags_and_needs_a_gpu(capsys, tiny_llama):
    line = _error(capsys, ["warmup", "--model", str(tiny_llama), "--frobnicate"])
    assert "lorapipe warmup: error: unrecognized arguments: --frobnicate" in line
    assert cli_main(["warmup", "--model", str(tiny_llama), "--device", "cpu", "--max-lora-rank", "16"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "lorapipe warmup: error: needs a CUDA device (--device cuda)"
