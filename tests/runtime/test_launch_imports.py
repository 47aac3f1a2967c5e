"""The launcher reaches the stages' spawn without importing torch: its checks (every --adapter included),
the model config, the host cache's size and the four stage configs use dtypes by name, the loader's
header checks (`adapter_check`) and the CUDA driver (`cuda_driver`). What they compute by name matches
what torch computes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.common.cuda_driver import cuda_device_count
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype, serving_dtype_name
from stages.loader.adapter_check import check_adapter
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_reader import read_adapter
from tests.conftest import NO_FIXED_PORTS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "triton", "safetensors", "transformers")

# The launcher's path up to spawning the stages (Launcher._start before StageProcess.start), in a fresh
# interpreter: pytest's own process imported torch long ago.
_LAUNCH_PATH = """
import shutil, sys
import runtime.cli, runtime.launcher
from runtime.base.endpoints import Endpoints, make_run_dir
from runtime.host_cache_size import host_cache_bytes
from runtime.serve_args import ServeArgsError
from runtime.serve_checks import parse_serve_args, validate
from runtime.stage_configs import stage_configs

args = parse_serve_args(sys.argv[1:])
model_cfg = validate(args)
run_dir = make_run_dir()
endpoints = Endpoints.in_run_dir(run_dir, client=args.endpoint)
configs = stage_configs(args, model_cfg, endpoints, "pool", host_cache_bytes(args, model_cfg))
assert sorted(configs) == ["loader", "scheduler", "tokenizer", "worker"], sorted(configs)
try:  # a CUDA check on a machine without CUDA is refused without torch too
    validate(parse_serve_args([*sys.argv[1:], "--device", "cuda"]))
except ServeArgsError as exc:
    print("cuda:", exc)
shutil.rmtree(run_dir)
print("heavy:", [m for m in HEAVY if m in sys.modules])
"""


@pytest.mark.timeout(60)
def test_the_launch_path_imports_no_torch(tiny_llama, llama_adapters):
    argv = ["--model", str(tiny_llama), "--device", "cpu", "--max-lora-rank", "16", *NO_FIXED_PORTS]
    for name, path in llama_adapters.items():
        argv += ["--adapter", f"{name}={path}"]
    code = f"HEAVY = {HEAVY!r}\n" + _LAUNCH_PATH
    res = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert res.returncode == 0, res.stderr
    assert "heavy: []" in res.stdout, res.stdout
    if cuda_device_count() == 0:
        assert "cuda: --device cuda: no CUDA device is available" in res.stdout, res.stdout


def test_dtype_names_match_torch(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    layout = LoraLayout.for_model(cfg, 16)
    for name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        assert parse_dtype(name, cfg.dtype) is dtype and parse_dtype("auto", name) is dtype
        assert serving_dtype_name(dtype, cfg.dtype) == name == serving_dtype_name(None, name)
        reference = layout.num_layers * 8 * layout.row_elems * torch.empty((), dtype=dtype).element_size()
        assert layout.block_bytes(8, name) == layout.block_bytes(8, dtype) == reference
    assert parse_dtype(None, cfg.dtype) is getattr(torch, cfg.dtype)
    with pytest.raises(ValueError, match="dtype 'int8'; choose one of float32, bfloat16, float16"):
        serving_dtype_name("int8", cfg.dtype)
    with pytest.raises(ValueError, match="unsupported dtype torch.int8"):
        parse_dtype(torch.int8, cfg.dtype)


def test_the_header_check_agrees_with_a_load(tiny_llama, llama_adapters):
    cfg = ModelConfig.from_dir(tiny_llama)
    layout = LoraLayout.for_model(cfg, 64)
    small = LoraLayout.for_model(cfg, 4)
    ranks = {n: read_adapter(n, p, cfg, layout, torch.float32).rank for n, p in llama_adapters.items()}
    name = next(n for n, r in ranks.items() if r > 4)
    path = llama_adapters[name]
    for n, p in llama_adapters.items():
        assert check_adapter(n, p, cfg, layout) == ranks[n]
    with pytest.raises(AdapterError) as load:
        read_adapter(name, path, cfg, small, torch.float32)
    with pytest.raises(AdapterError) as check:
        check_adapter(name, path, cfg, small)
    assert str(check.value) == str(load.value) and "exceeds max_lora_rank 4" in str(check.value)


def test_the_worker_reads_its_device_before_importing(tiny_llama, tmp_path):
    import dataclasses
    import importlib

    import msgspec

    from runtime.base.endpoints import Endpoints
    from runtime.host_cache_size import host_cache_bytes
    from runtime.serve_checks import parse_serve_args
    from runtime.stage_configs import stage_configs

    worker_main = importlib.import_module("stages.worker.__main__")
    for device in ("cpu", "cuda"):
        args = parse_serve_args(["--model", str(tiny_llama), "--device", "cpu", *NO_FIXED_PORTS])
        args = dataclasses.replace(args, device=device)  # no CUDA here: past the checks
        model_cfg = ModelConfig.from_dir(tiny_llama)
        endpoints = Endpoints.in_run_dir(tmp_path, client=args.endpoint)
        configs = stage_configs(args, model_cfg, endpoints, "p", host_cache_bytes(args, model_cfg))
        path = tmp_path / "worker.json"
        path.write_bytes(msgspec.json.encode(configs["worker"]))
        assert worker_main._device(["stages.worker", str(path)]) == configs["worker"].runner.device == device
    assert worker_main._device(["stages.worker", str(tmp_path / "missing.json")]) == ""
    assert worker_main._device(["stages.worker"]) == ""
