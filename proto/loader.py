"""Scheduler ⇄ adapter-loader messages (PUSH/PULL each way): stage an adapter into the shared-memory host
cache, pin it while the worker copies it, and hear back staged / failed / evicted."""

from __future__ import annotations

from proto.base import Message, edge


class StageAdapter(Message):
    """Read, validate and pack `path` into the host cache (a no-op when already staged); the block stays
    pinned (never evicted) until ReleaseAdapter. Answered by AdapterStaged or AdapterFailed."""

    name: str
    path: str


class ReleaseAdapter(Message):
    """The worker finished copying `name` into a slot: its host block may be evicted (LRU) again."""

    name: str


class DropAdapter(Message):
    """`name` was unloaded: free its host block now."""

    name: str


class AdapterStaged(Message):
    """`name` is packed in the host cache: everything a SlotLoad needs to copy it."""

    name: str
    shm_name: str
    offset: int
    nbytes: int
    rank: int
    layer_nbytes: int
    dtype: str = "bfloat16"
    slice_ranks: list[int] = []  # flat [num_layers * NUM_SLICES], layer-major
    slice_scalings: list[float] = []
    load_time: float = 0.0  # seconds spent reading + validating + packing (0 for a host-cache hit)
    cache_hit: bool = False


class AdapterFailed(Message):
    """`name` could not be loaded; `message` uses the offline engine's error texts."""

    name: str
    message: str
    retryable: bool = False  # a transient condition (host cache full of pinned blocks): ask again later


class LoaderStarted(Message):
    """The loader (re)started with an empty host cache: blocks staged before are gone, and every
    StageAdapter not answered yet must be sent again (what makes a loader restart transparent)."""

    pid: int


class Evicted(Message):
    """The host cache dropped `name` (LRU) to make room; the next use must stage it again."""

    name: str


class LoaderHealth(Message):
    """The loader's view of itself, sent whenever it changes: reads that overran their deadline and
    still hold a thread (a hung file system), out of the threads it has for reads."""

    stuck_reads: int
    read_threads: int
    detail: str = ""


SchedulerToLoader = edge("scheduler_to_loader", StageAdapter, ReleaseAdapter, DropAdapter)
LoaderToScheduler = edge(
    "loader_to_scheduler", LoaderStarted, AdapterStaged, AdapterFailed, Evicted, LoaderHealth
)
