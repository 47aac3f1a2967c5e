"""How many CUDA devices this process may use, asked of the CUDA driver (libcuda) without importing
torch: the launcher checks --device, `auto` and --tensor-parallel-size before it spawns the stages, and
importing torch there would put seconds in front of every start (each stage imports its own)."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata


def torch_has_cuda() -> bool:
    """Whether the installed torch was built for CUDA (a `+cpu` or `+rocm` build was not), read from
    its package metadata."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    local = version.partition("+")[2]
    return not local.startswith(("cpu", "rocm"))


@functools.cache
def cuda_device_count() -> int:
    """The devices the driver shows this process (CUDA_VISIBLE_DEVICES applies, as for torch); 0 where
    torch has no CUDA, there is no driver, or the driver does not initialise."""
    if not torch_has_cuda():
        return 0
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
