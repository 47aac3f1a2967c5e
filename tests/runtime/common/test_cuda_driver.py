"""The CUDA driver asked without torch (runtime/common/cuda_driver.py) agrees with torch on this machine,
and a context is made only for a CUDA device. (On a GPU: test_cuda_driver_gpu.py.)"""

from __future__ import annotations

import torch

from runtime.common.cuda_driver import (
    compute_capability,
    cuda_device_count,
    retain_primary_context,
    start_driver,
    start_primary_context,
    torch_has_cuda,
)


def test_the_driver_agrees_with_torch():
    thread = start_driver()  # initialised on a thread first, as `lorapipe serve` does
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert torch_has_cuda() == (torch.version.cuda is not None)
    assert cuda_device_count() == torch.cuda.device_count()
    assert retain_primary_context(0) == (torch.cuda.device_count() > 0)
    assert not retain_primary_context(cuda_device_count())  # one past the last device
    for ordinal in range(cuda_device_count()):
        assert compute_capability(ordinal) == torch.cuda.get_device_capability(ordinal)
    assert compute_capability(cuda_device_count()) is None


def test_a_context_only_for_a_cuda_device():
    for device in ("cpu", "", "cudax", "cuda:x", "meta"):
        assert start_primary_context(device) is None, device
    thread = start_primary_context("cuda")
    assert thread is not None and thread.daemon
    thread.join(60)
    assert not thread.is_alive()
