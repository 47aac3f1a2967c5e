"""On a GPU: `lorapipe warmup` on an empty compile cache compiles every recorded kernel in its pool, and a
second run (a server starting on that cache) compiles nothing, in the pool or in the worker; the cache
lives under its namespace (target, Triton version, kernel sources).
Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.synthetic.model import make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parents[3]


def _warmup(model: Path, cache: Path) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [
            sys.executable, "-m", "runtime.cli", "warmup", "--model", str(model), "--device", "cuda",
            "--compile-cache-dir", str(cache), "--max-lora-rank", "64", "--max-tokens-per-step", "256",
            "--max-running-requests", "32", "--lora-gpu-memory-gb", "0.05", "--num-pages", "256",
        ],  # fmt: skip
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_warm_up_on_the_same_cache_compiles_nothing(tmp_path):
    import triton

    model = make_model(tmp_path / "llama", arch="llama", preset="tiny", seed=1)
    cache = tmp_path / "cache"
    first = _warmup(model, cache)
    assert first["kernels"] > 0 and first["compiled"] == first["kernels"]
    assert Path(first["cache_dir"]).parent == cache.resolve()
    assert f"triton{triton.__version__}" in first["cache_dir"]
    second = _warmup(model, cache)
    assert second["cache_dir"] == first["cache_dir"]
    # the same plan's kernels (read from the cache); the graphs' own, recorded the first time with a
    # computed plan, are not recorded again
    assert 0 < second["kernels"] <= first["kernels"]
    assert second["compiled"] == 0 and second["compiled_in_worker"] == 0
