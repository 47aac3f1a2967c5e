"""On a GPU: the primary context the worker makes on a thread while it imports (runtime/common/cuda_driver.py)
is the one torch then uses, and the driver's device count and compute capabilities are torch's.
Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parents[3]

# a fresh process: the test session's own may hold a context already
_CODE = """
import ctypes, json, os, sys
from runtime.common.cuda_driver import _driver, compute_capability, cuda_device_count, start_primary_context
thread = start_primary_context("cuda:0")
thread.join(60)
driver, dev, flags, active = _driver(), ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
driver.cuDeviceGet(ctypes.byref(dev), 0)
driver.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
capabilities = [compute_capability(i) for i in range(cuda_device_count() + 1)]
torch_before = "torch" in sys.modules
import torch
total = int(torch.arange(4, device="cuda:0").sum().item())
print(json.dumps({"active": active.value, "torch_before": torch_before, "sum": total,
                  "loading": os.environ.get("CUDA_MODULE_LOADING"),
                  "count": cuda_device_count(), "torch_count": torch.cuda.device_count(),
                  "capabilities": capabilities,
                  "torch_capabilities": [list(torch.cuda.get_device_capability(i))
                                         for i in range(torch.cuda.device_count())] + [None]}))
"""


def test_the_context_made_on_a_thread_serves_torch():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    done = subprocess.run(
        [sys.executable, "-c", _CODE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["active"] == 1 and not got["torch_before"]
    assert got["sum"] == 6 and got["count"] == got["torch_count"] >= 1
    assert got["capabilities"] == got["torch_capabilities"]  # one past the last device: None
    assert got["loading"] == "LAZY"  # as torch sets it when it initialises the driver first
