"""`lorapipe warmup`: fill the compile cache ahead of serving (an image build on a GPU host, an init
container). It builds the worker's model runner from the same serving arguments the server would get,
so its warm-up plan (and its graph capture) compiles exactly the kernels that server's worker needs, into
the same cache directory (--compile-cache-dir), and exits."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from runtime.engine_args import runner_config
from runtime.stage_configs import compile_cache_dir

if TYPE_CHECKING:
    from runtime.common.model_config import ModelConfig
    from runtime.serve_args import ServeArgs


def run_warmup(args: ServeArgs, model_cfg: ModelConfig) -> int:
    """Build the runner with its warm-up on; print one summary line and a JSON line. Status 2 without a
    CUDA device (the plan asks the GPU for its SM count and capability)."""
    cfg = replace(runner_config(args, model_cfg), warmup=True)
    if not cfg.device.startswith("cuda"):
        print("lorapipe warmup: error: needs a CUDA device (--device cuda)", file=sys.stderr)
        return 2
    if args.tensor_parallel_size > 1:  # each rank's shard has its own shapes: warm up by serving
        print("lorapipe warmup: error: --tensor-parallel-size > 1 is not supported", file=sys.stderr)
        return 2
    os.environ["TRITON_CACHE_DIR"] = compile_cache_dir(args)  # the worker's; namespaced by the runner
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    import torch

    if not torch.cuda.is_available():
        print("lorapipe warmup: error: no CUDA device is visible", file=sys.stderr)
        return 2
    from stages.worker.runner import ModelRunner

    start = time.perf_counter()
    runner = ModelRunner(cfg)
    w = runner.warmup
    took = time.perf_counter() - start
    print(
        f"lorapipe warmup: {w.lora} LoRA and {w.attention} attention variants, {w.kernels} kernels "
        f"({w.compiled} compiled now) in {os.environ['TRITON_CACHE_DIR']}; runner ready in {took:.1f} s"
    )
    summary = {
        "cache_dir": os.environ["TRITON_CACHE_DIR"],
        "lora_variants": w.lora,
        "attention_variants": w.attention,
        "kernels": w.kernels,
        "compiled": w.compiled,
        "compiled_in_worker": w.compiled_here,
        "compiled_in_capture": len(runner.capture_compiled),
        "cache_complete": w.cached,  # found complete: no compile pool, no recording (warm_marker.py)
        "warmup_s": round(w.seconds, 3),
        "runner_s": round(took, 3),
    }
    print(json.dumps(summary))
    return 0
