"""Every CUDA graph the project records goes through `recording`: a capture whose errors are thread-local
(in the worker only the step thread issues CUDA work), with Python's automatic garbage collection paused.

A collection that runs inside a capture can free an unreachable object whose finalizer makes a CUDA call
that a capturing stream forbids: a `torch.cuda.CUDAGraph` (its reset destroys the executable graph), or
a Triton kernel in versions whose kernels unload their module when freed. The call fails ("operation not
permitted when stream is capturing") and invalidates the capture, which then ends with "operation failed
due to a previous error during capture". torch no longer collects before each capture (it was slow for
many captures in a row), so whether it happens depends on where the collector's allocation counts reach
their threshold: an intermittent failure of a capture at start-up (or of a decode graph captured on
first use). Pausing the collector for the capture's few milliseconds moves such frees to after it, where
they are safe."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def recording(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """Record `graph` from the work of the body, into the memory `pool` (the worker's graphs share one).
    Automatic collection is off from before the capture begins until it has ended, and back on after
    only if it was on; explicit `gc.collect()` calls are the caller's business."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()


# what torch.cuda.graph calls before each capture to give cached memory back (device; pinned host)
_CACHE_RELEASES = ((torch.cuda, "empty_cache"), (torch._C, "_host_emptyCache"))


@contextmanager
def caches_kept() -> Iterator[None]:
    """Within: `torch.cuda.graph` empties the allocator's device cache (and, where torch has one, its
    pinned-host cache) before the first capture only, as it does before every capture outside. Captures
    in a row (the worker's start-up: a hundred or more) otherwise each give back the memory of the eager
    run before them and take it again: a device synchronisation and driver frees and allocations each
    time. What stays cached is at most the eager run of the largest bucket, captured first: a full
    step's activations, which the KV cache's sizing keeps room for beside the graph pool (runner.py)."""
    released: set[str] = set()
    saved = [(mod, name, getattr(mod, name)) for mod, name in _CACHE_RELEASES if hasattr(mod, name)]

    def once(name: str, release):
        def first_only() -> None:
            if name not in released:
                released.add(name)
                release()

        return first_only

    for mod, name, release in saved:
        setattr(mod, name, once(name, release))
    try:
        yield
    finally:
        for mod, name, release in saved:
            setattr(mod, name, release)


def graph_pool_bytes(pool: tuple[int, int]) -> int:
    """Bytes of the allocator's segments that belong to the graph memory pool `pool`. (A difference of
    memory_reserved around the capture undercounts it: each capture first empties the allocator's cache,
    which gives back as much as small graphs take.)"""
    want = tuple(pool)
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == want)
