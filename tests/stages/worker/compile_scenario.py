"""Run by test_compile_pool.py in a fresh process (the test session runs Triton's interpreter, which
compiles nothing): records the LoRA launches of one warm-up variant on the CPU for an explicit CUDA target
(argv[2], a compute capability), compiles them, and writes the counts as JSON to argv[1]."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from kernels.batch_info import BatchInfo  # noqa: E402
from runtime.common.lora_layout import LoraLayout  # noqa: E402
from stages.worker.compile_pool import CompilePool, TargetDriver, compile_spec, recording  # noqa: E402
from stages.worker.lora.pool import LoraPool  # noqa: E402
from stages.worker.lora.triton_backend import TritonLoraBackend  # noqa: E402
from stages.worker.warmup_plan import lora_launches  # noqa: E402


def record(target: GPUTarget) -> list:
    """The specializations the launches of the plan's first LoRA variant (both layers) ask for."""
    driver.set_active(TargetDriver(target))
    layout = LoraLayout.build(num_layers=2, hidden=256, q_out=256, kv_out=64, intermediate=512, max_rank=16)
    pool = LoraPool(layout, 32, 2, torch.bfloat16, torch.device("cpu"))
    backend = TritonLoraBackend(pool, 64)
    launch = lora_launches(backend)[0]
    empty = backend.batch_info
    info = BatchInfo(
        meta=empty.meta,
        num_tokens=launch.num_tokens,
        num_tiles=launch.num_tiles,
        block_m=launch.block_m,
        max_len=1,
        block_rank=launch.block_rank,
        num_slots_used=1,
    )
    configs = backend.configs_for(info)
    group = layout.group(launch.group)
    x = torch.zeros((launch.num_tokens, group.in_dim), dtype=torch.bfloat16)
    out = torch.zeros((launch.num_tokens, group.out_total), dtype=torch.bfloat16)
    with recording() as specs:
        for layer in range(layout.num_layers):
            backend.apply_as(info, configs, x, out, layer, group)
    return specs


def main(out_path: str, arch: int) -> None:
    """With `arch` 90: the pool compiles, a second pass and the in-process path find everything cached.
    With another `arch` (run after, on the same cache): what the in-process path compiles."""
    target = GPUTarget("cuda", arch, 32)
    specs = record(target)
    result = {"specs": [s.data for s in specs], "names": sorted({s.name for s in specs})}
    if arch == 90:
        with CompilePool(target, workers=1) as pool:
            result["first"] = pool.compile(specs)
            result["second"] = pool.compile(specs)
    # The worker's own launch path after the pool: the JIT compiles (here: preloads) in this process.
    result["in_process"] = sum(compile_spec(s) for s in specs)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
