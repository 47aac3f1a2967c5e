"""Pitched host→device copies through the CUDA driver (`cuMemcpy2DAsync`): one DMA operation writes
`rows` rows of `width` bytes from a pinned host buffer (rows `src pitch` bytes apart) into device rows
`dst pitch` bytes apart.

A run of rank rows of an adapter goes to a run of pool rows in every layer, so both sides are strided
(the host block is `[layers, rank, row]`, the pool `[layers, total_rows, row]`). torch copies into a
strided destination through a device temporary and a spread kernel; for a 20 MB adapter those cost as
much as the transfer itself, and per-layer copies cost as much in launches. The driver's pitched copy
needs neither."""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch

_CU_MEMORYTYPE_HOST = 1
_CU_MEMORYTYPE_DEVICE = 2
_CUDA_ERROR_INVALID_CONTEXT = 201


class _Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (cuda.h), field for field."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class _Driver:
    def __init__(self, lib: ctypes.CDLL):
        self.memcpy2d = lib.cuMemcpy2DAsync_v2
        self.memcpy2d.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        self.memcpy2d.restype = ctypes.c_int
        self.error_name = lib.cuGetErrorName
        self.error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.error_name.restype = ctypes.c_int

    def describe(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self.error_name(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {code}"


@functools.cache
def _driver() -> _Driver | None:
    """The driver library of the process (None without one, e.g. a CPU-only build or machine)."""
    if not torch.cuda.is_available():
        return None
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def copy_rows(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> bool:
    """Queue on `stream` one copy of `src` (CPU; pinned, or the copy is synchronous; each `src[i]`
    contiguous, rows `src.stride(0)` elements apart) into `dst` (CUDA, same shape and dtype, each `dst[i]`
    contiguous, rows `dst.stride(0)` elements apart).
    Returns False, having done nothing, where the driver call cannot be made (no driver library, or no
    context current on this thread): the caller copies another way. The caller keeps `src` alive until
    the copy has completed on `stream`. Kept to a few checks: it runs on the path of every slot load."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"pitched copy of {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}"
        )
    if dst.device.type != "cuda" or src.device.type != "cpu":
        raise ValueError("pitched copy goes from host memory to a CUDA device")
    if dst.dim() < 1:
        raise ValueError("pitched copy needs contiguous source and destination rows")
    if src.numel() == 0:
        return True
    if not src[0].is_contiguous() or not dst[0].is_contiguous():
        raise ValueError("pitched copy needs contiguous source and destination rows")
    driver = _driver()
    if driver is None:
        return False
    item = src.element_size()
    width = src[0].numel() * item
    p = _Memcpy2D()
    p.srcMemoryType, p.srcHost, p.srcPitch = _CU_MEMORYTYPE_HOST, src.data_ptr(), src.stride(0) * item
    p.dstMemoryType, p.dstDevice, p.dstPitch = _CU_MEMORYTYPE_DEVICE, dst.data_ptr(), dst.stride(0) * item
    p.WidthInBytes, p.Height = width, src.shape[0]
    other = dst.device.index is not None and dst.device.index != torch.cuda.current_device()
    with torch.cuda.device(dst.device) if other else contextlib.nullcontext():
        code = driver.memcpy2d(ctypes.byref(p), ctypes.c_void_p(stream.cuda_stream))
    if code == _CUDA_ERROR_INVALID_CONTEXT:
        return False
    if code != 0:
        raise RuntimeError(
            f"cuMemcpy2DAsync of {src.shape[0]} rows x {width} B failed: {driver.describe(code)}"
        )
    return True
