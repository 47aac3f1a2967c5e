"""The host tier's shared-memory pool as three processes use it: the launcher creates and unlinks it, the
adapter-loader writes packed blocks into it, the gpu-worker maps it once, pins it and copies blocks out."""

from __future__ import annotations

import os
import secrets
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING

from proto.loader import AdapterStaged
from proto.plan import SlotLoad
from runtime.common.lora_layout import NUM_SLICES, LoraLayout
from runtime.common.model_config import dtype_name  # the wire name AdapterStaged/SlotLoad carry
from runtime.common.packed import PackedAdapter

if TYPE_CHECKING:  # the launcher creates and sizes the pool without torch; the views import it
    import torch

__all__ = [
    "attach_pool",
    "block_tensor",
    "close_pool",
    "create_pool",
    "dtype_name",
    "packed_from_pool",
    "pool_bytes_for",
    "register_pinned",
    "slot_load_for",
    "stop_resource_tracker",
    "unlink_pool",
    "unregister_pinned",
]

_SHM_DIR = "/dev/shm"
_attach_lock = threading.Lock()

ALIGN = 4096  # page-aligned blocks: contiguous, DMA-friendly copies


def pool_bytes_for(layout: LoraLayout, max_rank: int, dtype: torch.dtype | str, max_cpu_loras: int) -> int:
    """Room for `max_cpu_loras` blocks of rank `max_rank`, each rounded up to the cache's 4096 alignment."""
    block = layout.block_bytes(max_rank, dtype)
    return max_cpu_loras * ((block + ALIGN - 1) // ALIGN * ALIGN)


def create_pool(name_prefix: str, nbytes: int) -> SharedMemory:
    """The launcher's call: a fresh segment that outlives loader restarts. The launcher's
    resource_tracker still unlinks it if the launcher dies without calling `unlink_pool`."""
    if nbytes <= 0:
        raise ValueError(f"the host pool needs a positive size, got {nbytes}")
    if os.path.isdir(_SHM_DIR):  # tmpfs pages are allocated on first write: a short /dev/shm is a SIGBUS
        st = os.statvfs(_SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise OSError(
                f"the host cache needs {nbytes} bytes of shared memory but {_SHM_DIR} has {free} free; "
                "lower --cpu-lora-cache-gb or enlarge /dev/shm (docker: --shm-size)"
            )
    name = f"{name_prefix}{os.getpid()}-{secrets.token_hex(4)}"
    return SharedMemory(name=name, create=True, size=nbytes)


def attach_pool(name: str) -> SharedMemory:
    """Map an existing pool (loader, worker) without handing it to this process's resource_tracker:
    on Python < 3.13 `SharedMemory(name)` registers it, and the tracker would unlink the launcher's
    pool when this process exits (or is killed)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    register = resource_tracker.register

    def register_others(res_name: str, rtype: str) -> None:
        if rtype != "shared_memory":
            register(res_name, rtype)

    with _attach_lock:  # the patch is process-wide for the duration of one constructor
        resource_tracker.register = register_others
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def close_pool(shm: SharedMemory) -> bool:
    """Unmap the pool in this process; False (left mapped until exit) while tensor views still exist."""
    try:
        shm.close()
    except BufferError:
        return False
    return True


def unlink_pool(shm: SharedMemory) -> None:
    """The launcher's exit: unmap and remove the segment (idempotent)."""
    close_pool(shm)
    try:
        shm.unlink()
    except FileNotFoundError:  # someone else removed it: still forget it, or the tracker warns at exit
        if sys.version_info < (3, 13) or getattr(shm, "_track", True):
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def stop_resource_tracker() -> None:
    """The launcher's last step, once the pool is unlinked: end multiprocessing's resource tracker
    (its child) and reap it now, instead of leaving it to notice the launcher's exit a moment later."""
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    stop = getattr(tracker, "_stop", None)
    if stop is not None:
        try:
            stop()
        except (OSError, ChildProcessError):  # already gone
            pass


def block_tensor(
    shm: SharedMemory, offset: int, rank: int, layout: LoraLayout, dtype: torch.dtype
) -> torch.Tensor:
    """Zero-copy [num_layers, rank, row_elems] view of the block at byte `offset` of the pool."""
    import torch

    if not 0 < rank <= layout.max_rank:
        raise ValueError(f"block rank {rank} outside 1..{layout.max_rank}")
    nbytes = layout.block_bytes(rank, dtype)
    if offset < 0 or offset + nbytes > shm.size:
        raise ValueError(f"block [{offset}, {offset + nbytes}) is outside the {shm.size}-byte host pool")
    count = layout.num_layers * rank * layout.row_elems
    flat = torch.frombuffer(shm.buf, dtype=dtype, count=count, offset=offset)
    return flat.view(layout.num_layers, rank, layout.row_elems)  # [num_layers, rank, row_elems]


def slot_load_for(
    staged: AdapterStaged, slot: int, runs: list[tuple[int, int]], layered: bool = False
) -> SlotLoad:
    """The scheduler's SlotLoad for copying a staged adapter into adapter id `slot` at the pool rows of
    `runs` ((first row, rows) each, in rank order; `layered`: see SlotLoad)."""
    return SlotLoad(
        slot=slot,
        adapter=staged.name,
        shm_name=staged.shm_name,
        offset=staged.offset,
        nbytes=staged.nbytes,
        rank=staged.rank,
        layer_nbytes=staged.layer_nbytes,
        dtype=staged.dtype,
        slice_ranks=list(staged.slice_ranks),
        slice_scalings=list(staged.slice_scalings),
        layered=layered,
        row_starts=[start for start, _ in runs],
        row_counts=[n for _, n in runs],
    )


def packed_from_pool(
    shm: SharedMemory, load: SlotLoad, layout: LoraLayout, dtype: torch.dtype
) -> PackedAdapter:
    """The worker's view of a staged block as a PackedAdapter (block zero-copy in the pool; ranks and
    scalings rebuilt from the flat lists). Keep it alive until the copy out of it has completed."""
    import torch

    if load.dtype != dtype_name(dtype):
        raise ValueError(f"adapter {load.adapter!r} was packed as {load.dtype}, the worker runs {dtype}")
    block = block_tensor(shm, load.offset, load.rank, layout, dtype)
    layer_nbytes = load.rank * layout.row_elems * block.element_size()
    if load.nbytes != layout.num_layers * layer_nbytes or load.layer_nbytes != layer_nbytes:
        raise ValueError(f"adapter {load.adapter!r}: staged sizes do not match this model's layout")
    n = layout.num_layers * NUM_SLICES
    if len(load.slice_ranks) != n or len(load.slice_scalings) != n:
        raise ValueError(f"adapter {load.adapter!r}: expected {n} slice ranks and scalings")
    ranks = torch.tensor(load.slice_ranks, dtype=torch.int32).view(layout.num_layers, NUM_SLICES)
    scalings = torch.tensor(load.slice_scalings, dtype=torch.float32).view(layout.num_layers, NUM_SLICES)
    return PackedAdapter(name=load.adapter, block=block, ranks=ranks, scalings=scalings)


def _base_address(shm: SharedMemory) -> int:
    import torch

    view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=1)
    ptr = view.data_ptr()
    del view  # release the buffer export at once, so the pool can still be closed
    return ptr


def register_pinned(shm: SharedMemory) -> bool:
    """Page-lock the whole pool for the CUDA driver (the worker, once after attaching), so block copies
    run at pinned bandwidth and may be asynchronous. No-op (False) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(_base_address(shm), shm.size, 0)
    torch.cuda.check_error(err)
    return True


def unregister_pinned(shm: SharedMemory) -> None:
    """Undo `register_pinned` (before closing the pool). No-op without CUDA."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(_base_address(shm)))
