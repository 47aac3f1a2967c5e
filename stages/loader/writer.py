"""`python -m stages.loader.writer ADDRESS IDENTITY POOL_NAME PARENT_PID`: one part-writer process of the
adapter-loader. It attaches the shared host pool, says WriterReady, then for each WritePart opens the
tensor file (refusing any file but the one the loader planned), zeroes the gaps it is given, reads its
part, checks its values and packs it into the block, and answers PartDone. One part at a time, on its
own interpreter: the loader's parts never wait on one GIL. It dies with the loader (PDEATHSIG)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import torch

from proto.loader_parts import FileId, LoaderToWriter, PartDone, WritePart, WriterReady, WriterToLoader
from runtime.base.parent_death import arm
from runtime.base.sockets import DealerSocket
from runtime.common.host_pool import attach_pool
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_plan import AdapterPlan, Segment
from stages.loader.block_writer import SegmentBuffer, prepare, write_part, zero_gaps
from stages.loader.process import tune_for_loads
from stages.loader.safetensors_reader import FormatError, open_regular

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NONE = torch.empty(0)


def file_id(fd: int) -> FileId:
    st = os.fstat(fd)
    return FileId(dev=st.st_dev, ino=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)


def write(msg: WritePart, pool: SharedMemory, buf: SegmentBuffer) -> PartDone:
    """Carry out one WritePart; every failure is a PartDone naming it."""
    try:
        return PartDone(job=msg.job, peaks=_write(msg, pool, buf))
    except AdapterError as e:
        return PartDone(job=msg.job, error=e.reason, adapter_fault=True)
    except Exception as e:  # a bug, or a message no loader sends: the load fails, the writer lives on
        return PartDone(job=msg.job, error=f"{type(e).__name__}: {e}")


def _write(msg: WritePart, pool: SharedMemory, buf: SegmentBuffer) -> list[float]:
    dtype = DTYPES[msg.dtype]
    count = msg.num_layers * msg.rank * msg.row_elems
    if msg.offset < 0 or msg.offset + count * dtype.itemsize > pool.size:
        raise ValueError(f"block at {msg.offset} of {count} {msg.dtype} items is outside the host pool")
    try:
        fd, size = open_regular(Path(msg.path), msg.file.size)
    except FormatError as e:
        raise AdapterError(msg.name, f"adapter_model.safetensors is gone or changed ({e})") from None
    part = msg.part
    plan = AdapterPlan(
        name=msg.name,
        fd=fd,
        dtype=dtype,
        rank=msg.rank,
        num_layers=msg.num_layers,
        row_elems=msg.row_elems,
        ranks=_NONE,
        scalings=_NONE,
        segments=[Segment(start=part.start, end=part.end, pieces=(), parts=(part,))],
        gaps=list(msg.gaps),
        deadline=msg.deadline,
        file_bytes=size,
    )
    with plan:
        if file_id(fd) != msg.file:
            raise AdapterError(msg.name, "adapter_model.safetensors changed while it was being loaded")
        flat = torch.frombuffer(pool.buf, dtype=dtype, count=count, offset=msg.offset)
        block = flat.view(msg.num_layers, msg.rank, msg.row_elems)  # [num_layers, rank, row_elems]
        try:
            zero_gaps(plan, block)
            prepare(plan, 0, buf)
            write_part(plan, 0, 0, buf, block)
        finally:
            del block, flat  # no view may outlive the call (the pool must stay closable)
    return plan.peaks


async def serve(address: str, identity: bytes, pool: SharedMemory) -> None:
    sock: DealerSocket = DealerSocket(address, LoaderToWriter, WriterToLoader, linger_ms=0, identity=identity)
    buf = SegmentBuffer()
    try:
        await sock.send(WriterReady(pid=os.getpid()))
        while True:
            await sock.send(write(await sock.recv(), pool, buf))
    finally:
        sock.close()


def main(argv: list[str]) -> None:
    address, identity, pool_name, parent = argv
    # SIGKILLed when the loader dies, even stopped or stuck in a read: the loader owns every block
    if not arm(signal.SIGKILL, int(parent)):
        os._exit(1)  # the loader went before the signal was armed
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # nothing to flush: the loader owns every block
    tune_for_loads()
    pool = attach_pool(pool_name)
    asyncio.run(serve(address, identity.encode(), pool))


if __name__ == "__main__":
    main(sys.argv[1:])
