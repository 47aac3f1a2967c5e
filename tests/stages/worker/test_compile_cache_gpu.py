"""On a GPU: `lorapipe warmup` on an empty compile cache compiles every recorded kernel in its pool, and a
second run (a server starting on that cache) compiles nothing, in the pool or in the worker, and starts
no pool; the cache lives under its namespace (target, Triton version, kernel sources).
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
    assert not first["cache_complete"]
    second = _warmup(model, cache)
    assert second["cache_dir"] == first["cache_dir"]
    # the first run left the cache's marker (nothing compiled in its worker): the second starts no pool
    # and records nothing; its launches load every kernel
    assert second["cache_complete"] and second["kernels"] == 0
    assert second["compiled"] == 0 and second["compiled_in_worker"] == 0 == second["compiled_in_capture"]
    markers = list(Path(first["cache_dir"]).glob("lorapipe-warm-*.json"))
    assert len(markers) == 1
    # a kernel gone from the cache: compiled in the worker before ready, and the marker goes
    kernel = next(p for p in Path(first["cache_dir"]).rglob("*.cubin"))
    for sibling in kernel.parent.iterdir():
        sibling.unlink()
    third = _warmup(model, cache)
    assert third["cache_complete"] and third["compiled_in_worker"] + third["compiled_in_capture"] >= 1
    assert not markers[0].exists()
    fourth = _warmup(model, cache)  # the pool again, finding everything
    assert not fourth["cache_complete"] and fourth["kernels"] > 0 and fourth["compiled_in_worker"] == 0
    assert markers[0].exists()
