"""`--cpu-lora-cache-gb` sizes the host pool in bytes; `--max-cpu-loras` alone keeps its old meaning (room
for that many max-rank adapters) and otherwise only caps the count; a cache too small for one max-rank
adapter is refused up front; the loader and scheduler configs carry the cap and the thread count."""

from __future__ import annotations

import pytest
import torch

from runtime.base.endpoints import Endpoints
from runtime.common.host_pool import pool_bytes_for
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.host_cache_size import DEFAULT_CPU_LORA_CACHE_GB, host_cache_bytes
from runtime.serve_args import ServeArgsError
from runtime.serve_checks import parse_serve_args
from runtime.stage_configs import stage_configs
from tests.conftest import NO_FIXED_PORTS


def args(tiny_llama, *flags: str):
    argv = ["--model", str(tiny_llama), "--device", "cpu", "--max-lora-rank", "16", *NO_FIXED_PORTS, *flags]
    return parse_serve_args(argv)


def test_sizes(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    max_rank_block = pool_bytes_for(LoraLayout.for_model(cfg, 16), 16, torch.float32, 1)
    assert host_cache_bytes(args(tiny_llama, "--cpu-lora-cache-gb", "0.5"), cfg) == 2**29
    assert host_cache_bytes(args(tiny_llama, "--cpu-lora-cache-gb", "0.001"), cfg) == 1073741 // 4096 * 4096
    assert host_cache_bytes(args(tiny_llama, "--max-cpu-loras", "3"), cfg) == 3 * max_rank_block
    both = args(tiny_llama, "--max-cpu-loras", "3", "--cpu-lora-cache-gb", "0.25")
    assert host_cache_bytes(both, cfg) == 2**28 and both.max_cpu_loras == 3
    default = args(tiny_llama)
    assert host_cache_bytes(default, cfg) == int(DEFAULT_CPU_LORA_CACHE_GB * 2**30)
    assert default.max_cpu_loras is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--cpu-lora-cache-gb", "0"), "--cpu-lora-cache-gb must be positive"),
        (("--cpu-lora-cache-gb", "1e-6"), "hold no adapter of rank 16 (--max-lora-rank)"),
        (("--max-cpu-loras", "0"), "--max-cpu-loras must be positive"),
        (("--loader-threads", "0"), "--loader-threads must be positive"),
        (("--loader-writers", "-1"), "--loader-writers must not be negative, got -1"),
    ],
)
def test_refused(tiny_llama, flags, message):
    with pytest.raises(ServeArgsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        args(tiny_llama, *flags)


def test_stage_configs_carry_the_cap_and_threads(tiny_llama, tmp_path):
    a = args(tiny_llama, "--cpu-lora-cache-gb", "0.01", "--loader-threads", "5", "--loader-writers", "3")
    cfg = ModelConfig.from_dir(tiny_llama)
    configs = stage_configs(a, cfg, Endpoints.in_run_dir(tmp_path), "pool", host_cache_bytes(a, cfg))
    loader, scheduler = configs["loader"], configs["scheduler"]
    assert scheduler.max_cpu_loras is None and scheduler.host_cache_bytes == host_cache_bytes(a, cfg)
    assert loader.load_threads == 5 and loader.host_pool_bytes == host_cache_bytes(a, cfg)
    assert loader.writers == 3
    capped = args(tiny_llama, "--max-cpu-loras", "7")
    configs = stage_configs(capped, cfg, Endpoints.in_run_dir(tmp_path), "pool", 4096)
    assert configs["scheduler"].max_cpu_loras == 7  # the scheduler alone places host blocks
    assert configs["loader"].load_threads >= 2
