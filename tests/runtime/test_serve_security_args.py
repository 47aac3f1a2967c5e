"""`lorapipe serve` security and limit flags: each wrong value is a clear start-up error, and the
right ones reach the tokenizer's and the loader's configs (key, root resolved, limits)."""

from __future__ import annotations

import os

import pytest

from runtime.base.endpoints import Endpoints
from runtime.cli import main as cli_main
from runtime.serve_checks import parse_serve_args, validate
from runtime.stage_configs import stage_configs
from tests.conftest import NO_FIXED_PORTS

KEY = "0123456789abcdef-key"


def test_security_flag_errors(tiny_llama, tmp_path, capsys, default_ports_taken):
    loose = tmp_path / "loose.key"
    loose.write_text(KEY)
    loose.chmod(0o644)
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo)
    fifo.chmod(0o600)
    cases = [
        (["--adapter-root", str(tmp_path / "none")], "--adapter-root"),
        (["--adapter-root", str(tmp_path), "--allow-any-adapter-path"], "not both"),
        (["--api-key", "short"], "at least 16 characters"),
        (["--api-key", KEY, "--api-key-file", str(loose)], "not allowed with argument"),
        (["--api-key-file", str(loose)], "readable by other users"),
        (["--api-key-file", str(fifo)], "not a regular file"),
        (["--api-key-file", str(tmp_path / "missing")], "--api-key-file"),
        (["--max-request-bytes", "10"], "--max-request-bytes must be at least 1024"),
        (["--max-prompt-bytes", "-1"], "--max-prompt-bytes must not be negative"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exc:
            cli_main(["serve", "--model", str(tiny_llama), "--device", "cpu", *NO_FIXED_PORTS, *flags])
        assert exc.value.code == 2, flags
        err = capsys.readouterr().err
        assert message in err, (flags, err)
        assert KEY not in err


def test_security_flags_reach_the_stage_configs(tiny_llama, llama_adapters, tmp_path, default_ports_taken):
    key_file = tmp_path / "api.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    (tmp_path / "root").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "root")
    args = parse_serve_args(
        [
            "--model", str(tiny_llama), "--device", "cpu", "--adapter", f"a={llama_adapters['full8']}",
            "--api-key-file", str(key_file), "--adapter-root", str(tmp_path / "link"),
            "--no-runtime-adapter-loading", "--max-request-bytes", "65536", "--max-prompt-bytes", "4096",
            *NO_FIXED_PORTS,
        ]
    )  # fmt: skip
    model_cfg = validate(args)
    configs = stage_configs(args, model_cfg, Endpoints.in_run_dir(tmp_path), "pool", 4096)
    tok, loader = configs["tokenizer"], configs["loader"]
    assert tok.api_key == KEY and not tok.runtime_adapter_loading
    assert (tok.max_client_msg_bytes, tok.max_prompt_bytes) == (65536, 4096)
    assert tok.adapter_root == loader.adapter_root == os.path.realpath(tmp_path / "root")
    assert loader.trusted_paths == (os.path.realpath(llama_adapters["full8"]),)
    assert not tok.allow_any_adapter_path
    flags = ["--model", str(tiny_llama), "--device", "cpu", "--allow-any-adapter-path", *NO_FIXED_PORTS]
    anywhere = parse_serve_args(flags)
    configs = stage_configs(anywhere, validate(anywhere), Endpoints.in_run_dir(tmp_path), "pool", 4096)
    assert configs["tokenizer"].allow_any_adapter_path and configs["tokenizer"].adapter_root is None
