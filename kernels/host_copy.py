"""Host-to-device uploads of a step's small inputs that never queue behind bulk DMA transfers.

The H100's copy engine serves host-to-device copies in the order they were queued, whatever their stream
or its priority: a step's 48 KB input copy queued just after an adapter's 32 layer copies (335 MB, on the
worker's load stream) finishes only with the last of them, 6.2 ms later, and the step waits for it. A
copy would let an overlapped load hide nothing from the step that needs it, and every step staged while
a load is queued would start late. An upload here is an ordinary elementwise kernel on the
current stream instead: it reads the pinned host buffer through its device mapping (with unified virtual
addressing a pinned allocation's host address is valid on the device), so only the stream's own order
applies. A kernel reads PCIe well below the copy engine's bandwidth, which costs nothing at the tens of KB
a step uploads. Without CUDA, or for a buffer that is not pinned, it is a plain non-blocking copy.

The host buffer must stay unchanged until the upload has run (record an event after it, as for any
non-blocking copy); the caching host allocator does not know of these reads, so only long-lived buffers
(the staging rings) are uploaded this way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _DeviceAddress:
    """`__cuda_array_interface__` of `nbytes` bytes at a device-valid address, for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False)}
        self.__cuda_array_interface__["version"] = 3


def mapped(host: torch.Tensor) -> torch.Tensor | None:
    """A CUDA tensor aliasing the pinned, contiguous CPU tensor `host` (same address, same shape and dtype;
    reads go over PCIe), or None where there is none: no CUDA, not pinned, or torch would not alias it.
    It is on the device the memory was pinned against; `upload` to another device copies instead."""
    if host.device.type != "cpu" or not torch.cuda.is_available() or host.numel() == 0:
        return None
    if not host.is_contiguous() or not host.is_pinned():
        return None
    raw = torch.as_tensor(_DeviceAddress(host.data_ptr(), host.numel() * host.element_size()))
    if raw.device.type != "cuda" or raw.data_ptr() != host.data_ptr():
        return None  # a copy, not a mapping: useless for uploads
    return raw.view(host.dtype).view(host.shape)


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def upload(dst: torch.Tensor, src: torch.Tensor, src_mapped: torch.Tensor | None) -> None:
    """dst ← src (same shape and dtype; `dst` on the device, `src` on the host). With `src_mapped`, the
    device mapping of `src` (or of the same slice of it), a kernel on the current stream reads it; else a
    non-blocking copy, which a copy engine serves in its queue's order."""
    if src_mapped is None or src_mapped.device != dst.device:
        dst.copy_(src, non_blocking=True)
        return
    if src_mapped.shape != dst.shape or src_mapped.dtype != dst.dtype:
        got, want = (tuple(src_mapped.shape), src_mapped.dtype), (tuple(dst.shape), dst.dtype)
        raise ValueError(f"upload of {got} into {want}")
    torch.bitwise_or(_as_ints(src_mapped), 0, out=_as_ints(dst))  # a device-side read of host memory


class PinnedBuffer:
    """A pinned host tensor (plain memory without CUDA) with its device mapping and the event of its last
    upload, so it is rewritten only once that upload has run."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool):
        self.host = torch.zeros(numel, dtype=dtype, pin_memory=pin)
        self.device_view = mapped(self.host) if pin else None
        self.event = torch.cuda.Event() if pin else None
        self.used = False

    def wait_free(self) -> None:
        if self.event is not None and self.used and not self.event.query():
            self.event.synchronize()  # a ring lapped an upload still queued: practically never

    def upload(self, dst: torch.Tensor, n: int | None = None) -> None:
        """dst ← the first `n` elements (all by default); records the event."""
        n = self.host.numel() if n is None else n
        upload(dst, self.host[:n], None if self.device_view is None else self.device_view[:n])
        if self.event is not None:
            self.event.record()
            self.used = True


class IndexUploads:
    """Small int64 vectors for the device (gather indices of a step's logits): a ring of pinned buffers of
    `capacity` entries uploaded by kernel into a ring of device buffers. Consumers must run on the stream
    of the upload before `ring` later uploads (a step's gather does). Longer vectors take a plain copy."""

    def __init__(self, capacity: int, device: torch.device, ring: int = 4):
        self.capacity, self.device = capacity, device
        pin = device.type == "cuda"
        self._host = [PinnedBuffer(capacity, torch.int64, pin) for _ in range(ring)]
        self._dev = [torch.zeros(capacity, dtype=torch.int64, device=device) for _ in range(ring)]
        self._next = 0

    def __call__(self, values: Sequence[int]) -> torch.Tensor:
        n = len(values)
        if n > self.capacity:
            index = torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            return index.to(self.device, non_blocking=True)
        i, self._next = self._next, (self._next + 1) % len(self._host)
        buf = self._host[i]
        buf.wait_free()
        buf.host.numpy()[:n] = np.asarray(values, dtype=np.int64)
        buf.upload(self._dev[i][:n], n)
        return self._dev[i][:n]
