"""Scheduler ⇄ adapter-loader messages (PUSH/PULL each way). The scheduler owns the host cache's table:
it places each block and tells the loader where to write it; the loader reads, validates and packs,
then answers. The loader keeps no table of blocks, holds or pins."""

from __future__ import annotations

from proto.base import Message, edge


class StageAdapter(Message):
    """Read, validate and pack `path` into the host pool at [offset, offset + capacity), the range the
    scheduler reserved (the block of a rank-r adapter takes its own rank's bytes, at most `capacity`).
    Answered by exactly one AdapterStaged or AdapterFailed carrying the same `write_id`; nothing outside
    the range is written."""

    name: str
    path: str
    offset: int
    capacity: int
    write_id: int


class AdapterStaged(Message):
    """`name` is packed at `offset` of the host pool: everything a SlotLoad needs to copy it."""

    name: str
    shm_name: str
    offset: int
    nbytes: int
    rank: int
    layer_nbytes: int
    dtype: str = "bfloat16"
    slice_ranks: list[int] = []  # flat [num_layers * NUM_SLICES], layer-major
    slice_scalings: list[float] = []
    load_time: float = 0.0  # seconds spent reading + validating + packing
    write_id: int = 0


class AdapterFailed(Message):
    """The write of `name` failed; `message` uses the offline engine's error texts. `stage_fault`: the
    loader itself failed (a handler error, not the adapter's files): the adapter may be tried again."""

    name: str
    message: str
    write_id: int = 0
    stage_fault: bool = False


class LoaderStarted(Message):
    """The loader (re)started: writes it had not answered are lost (the scheduler frees their ranges and
    asks again); blocks already staged stay valid, since the pool outlives the loader."""

    pid: int


class LoaderHealth(Message):
    """The loader's view of itself, sent whenever it changes: reads that overran their deadline and
    still hold a thread (a hung file system), out of the threads it has for reads, and the messages its
    handlers failed on."""

    stuck_reads: int
    read_threads: int
    detail: str = ""
    handler_failures: int = 0


SchedulerToLoader = edge("scheduler_to_loader", StageAdapter)
LoaderToScheduler = edge("loader_to_scheduler", LoaderStarted, AdapterStaged, AdapterFailed, LoaderHealth)
