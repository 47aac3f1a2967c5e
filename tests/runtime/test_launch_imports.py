"""The launcher reaches the stages' spawn without importing torch, fp8 weights and tensor parallelism
included: its checks (every --adapter included), the model config, the host cache's size and the four
stage configs use dtypes by name, the loader's header checks (`adapter_check`) and the CUDA driver
(`cuda_driver`: device count, compute capability). What they compute by name matches what torch
computes, and the device checks refuse with the worker's own words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.common import cuda_driver
from runtime.common.cuda_driver import cuda_device_count
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype, serving_dtype_name
from runtime.common.quant_config import fp8_device_problem
from runtime.serve_args import ServeArgsError
from runtime.serve_checks import parse_serve_args
from runtime.synthetic.fp8 import write_fp8
from runtime.synthetic.model import make_model
from stages.loader.adapter_check import check_adapter
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_reader import read_adapter
from stages.worker.model.linear import check_fp8_device
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
    cuda_args = parse_serve_args([*sys.argv[1:], "--device", "cuda"])
    cuda_cfg = validate(cuda_args)
    stage_configs(cuda_args, cuda_cfg, endpoints, "pool", host_cache_bytes(cuda_args, cuda_cfg))
except ServeArgsError as exc:
    print("cuda:", exc)
else:
    print("cuda: accepted")
shutil.rmtree(run_dir)
print("heavy:", [m for m in HEAVY if m in sys.modules])
"""


# A host whose CUDA driver shows GPUS devices of compute capability CAPABILITY (this one has none): the
# launcher's CUDA checks then run as on a GPU host, and must import no torch either.
_DRIVER = """
from runtime.common import cuda_driver
cuda_driver.cuda_device_count = lambda: GPUS
cuda_driver.compute_capability = lambda ordinal: CAPABILITY if ordinal < GPUS else None
"""


def _launch(argv: list[str], gpus: int = 0, capability: tuple[int, int] = (0, 0)) -> str:
    """The launch path's output in a fresh interpreter (a driver showing `gpus` GPUs of `capability`,
    where `gpus` is given); asserts it imported nothing heavy."""
    code = f"HEAVY = {HEAVY!r}\nGPUS = {gpus}\nCAPABILITY = {capability!r}\n"
    code += (_DRIVER if gpus else "") + _LAUNCH_PATH
    res = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert res.returncode == 0, res.stderr
    assert "heavy: []" in res.stdout, res.stdout
    return res.stdout


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory) -> Path:
    """A pre-quantized (compressed-tensors, per-channel) copy of a tiny bf16 llama."""
    root = tmp_path_factory.mktemp("fp8_launch")
    bf16 = make_model(root / "bf16", preset="tiny", dtype="bfloat16", seed=3)
    return write_fp8(bf16, root / "fp8", "compressed-tensors")


@pytest.mark.timeout(120)
def test_the_launch_path_imports_no_torch(tiny_llama, llama_adapters, fp8_llama):
    base = ["--device", "cpu", "--max-lora-rank", "16", *NO_FIXED_PORTS]
    adapters = [f for name, path in llama_adapters.items() for f in ("--adapter", f"{name}={path}")]
    no_cuda = "cuda: --device cuda: no CUDA device is available"
    runs = [  # (argv, what the same flags with --device cuda give on a machine without CUDA)
        (["--model", str(tiny_llama), *base, *adapters], no_cuda),
        (["--model", str(tiny_llama), *base, *adapters, "--quantization", "fp8"], no_cuda),
        (["--model", str(fp8_llama), *base], no_cuda),
        (
            ["--model", str(tiny_llama), *base, *adapters, "--tensor-parallel-size", "2"],
            "cuda: --tensor-parallel-size 2: only 0 CUDA devices are visible",
        ),
    ]
    for argv, refused in runs:
        out = _launch(argv)
        if cuda_device_count() == 0:
            assert refused in out, (argv, out)
    fp8 = ["--dtype", "bfloat16", "--quantization", "fp8"]
    fp8_tp = ["--model", str(tiny_llama), *base, *adapters, *fp8, "--tensor-parallel-size", "2"]
    assert "cuda: accepted" in _launch(fp8_tp, gpus=2, capability=(9, 0))
    assert "cuda: accepted" in _launch(["--model", str(fp8_llama), *base], gpus=1, capability=(8, 9))
    out = _launch(fp8_tp, gpus=2, capability=(8, 0))
    assert f"cuda: --quantization fp8: {fp8_device_problem((8, 0), 'bfloat16')}" in out, out
    out = _launch(fp8_tp, gpus=1, capability=(9, 0))
    assert "cuda: --tensor-parallel-size 2: only 1 CUDA devices are visible" in out, out


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_cuda_checks_read_the_driver(monkeypatch, tiny_llama, fp8_llama, gpus):
    """On a host whose driver shows `gpus` GPUs of a given capability: fp8 weights (asked for, or the
    checkpoint's) and a tensor-parallel size are refused before any stage starts, in one line naming the
    flag, or accepted."""

    def serve(model, *flags):
        return parse_serve_args(["--model", str(model), "--device", "cuda", *flags, *NO_FIXED_PORTS])

    monkeypatch.setattr(cuda_driver, "cuda_device_count", lambda: gpus)
    for capability in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]:
        monkeypatch.setattr(cuda_driver, "compute_capability", lambda ordinal, c=capability: c)
        for model, flag, quantize in [
            (tiny_llama, "--quantization fp8", ["--quantization", "fp8"]),
            (fp8_llama, f"--model {fp8_llama}", []),
        ]:
            for dtype in ("bfloat16", "float16", "float32"):
                problem = fp8_device_problem(capability, dtype)
                if problem is None:
                    serve(model, "--dtype", dtype, *quantize)
                    continue
                with pytest.raises(ServeArgsError) as exc:
                    serve(model, "--dtype", dtype, *quantize)
                assert str(exc.value) == f"{flag}: {problem}"
        assert serve(tiny_llama, "--dtype", "float16").quantization is None  # no fp8: no capability asked
    if gpus >= 2:
        assert serve(tiny_llama, "--tensor-parallel-size", "2").tensor_parallel_size == 2
    else:
        with pytest.raises(
            ServeArgsError, match="^--tensor-parallel-size 2: only 1 CUDA devices are visible$"
        ):
            serve(tiny_llama, "--tensor-parallel-size", "2")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_fp8_device_check_speaks_the_workers_words(monkeypatch, dtype):
    """Every capability from 7.0 to 10.9 and every serving dtype: the launcher's torch-free check refuses
    exactly where the worker's `check_fp8_device` does, with its message."""
    for capability in [(major, minor) for major in (7, 8, 9, 10) for minor in range(10)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        try:
            check_fp8_device(torch.device("cuda"), getattr(torch, dtype), probe=False)
            expected = None
        except ValueError as exc:
            expected = str(exc)
        assert fp8_device_problem(capability, dtype) == expected, (capability, dtype)


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
