"""The CUDA driver (libcuda) asked directly, without importing torch: how many devices this process may
use and a device's compute capability (the launcher checks --device, `auto`, --tensor-parallel-size and
fp8 weights before it spawns the stages, and importing torch there would put seconds in front of every
start), and the device's primary context made on a thread while the gpu-worker still imports torch
(torch's runtime then finds it made)."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import threading


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
def _driver() -> ctypes.CDLL | None:
    """libcuda, initialised; None where torch has no CUDA, there is no driver, or it fails to start."""
    if not torch_has_cuda():
        return None
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    # read by the driver once, at its initialisation: the lazy module loading torch asks for when it is
    # the first to initialise it (otherwise every kernel of every library loads with the context)
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    return driver if driver.cuInit(0) == 0 else None


def cuda_device_count() -> int:
    """The devices the driver shows this process (CUDA_VISIBLE_DEVICES applies, as for torch); 0 without
    a usable driver."""
    driver, count = _driver(), ctypes.c_int(0)
    if driver is None or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


# cuda.h's CUdevice_attribute values (fixed by the driver's ABI)
_COMPUTE_CAPABILITY_MAJOR, _COMPUTE_CAPABILITY_MINOR = 75, 76


def compute_capability(ordinal: int) -> tuple[int, int] | None:
    """Device `ordinal`'s (major, minor) compute capability, as torch.cuda.get_device_capability gives
    it; None where there is no such device or driver."""
    driver, dev = _driver(), ctypes.c_int(0)
    if driver is None or driver.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return None
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    for out, attribute in ((major, _COMPUTE_CAPABILITY_MAJOR), (minor, _COMPUTE_CAPABILITY_MINOR)):
        if driver.cuDeviceGetAttribute(ctypes.byref(out), attribute, dev) != 0:
            return None
    return major.value, minor.value


def retain_primary_context(ordinal: int) -> bool:
    """Make (or keep) the primary context of device `ordinal`, the one torch's runtime uses; held for
    the process's life. False where there is no such device or driver."""
    driver, dev, ctx = _driver(), ctypes.c_int(0), ctypes.c_void_p()
    if driver is None or driver.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return False
    return driver.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0


def start_primary_context(device: str) -> threading.Thread | None:
    """For a CUDA `device` ("cuda", "cuda:N"): a started daemon thread making its primary context (the
    driver's calls release the GIL: imports go on meanwhile); None for any other device."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        return None
    thread = threading.Thread(
        target=retain_primary_context, args=(int(index or 0),), name="cuda-context", daemon=True
    )
    thread.start()
    return thread


def start_driver() -> threading.Thread:
    """A started daemon thread initialising the driver (`_driver`: about half a second on a GPU host; its
    calls release the GIL), so that whoever asks it later (the launcher's device checks) finds it ready
    while this thread's time overlapped the imports and argument parsing before them."""
    thread = threading.Thread(target=_driver, name="cuda-driver", daemon=True)
    thread.start()
    return thread
