"""Every CUDA graph the project records goes through `recording`: a capture whose errors are thread-local
(in the worker only the step thread issues CUDA work), on a side stream without a device synchronisation
before it, with Python's automatic garbage collection paused.

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

_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """The side stream every capture on `device` (default: the current one) records on: one per device,
    as torch.cuda.graph's own default (capture cannot run on the legacy default stream)."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(index)
    return stream


@contextmanager
def recording(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """Record `graph` from the work of the body, into the memory `pool` (the worker's graphs share one),
    on the capture stream of the current device. Automatic collection is off from before the capture
    begins until it has ended, and back on after only if it was on; explicit `gc.collect()` calls are
    the caller's business.

    Unlike torch.cuda.graph, it neither synchronises the device nor empties the allocator's cache first.
    A capture computes nothing and reads no result of earlier work, so it need not wait for it: the eager
    run before each of the worker's start-up captures (which loads its kernels) keeps the device busy
    while the host records the next graphs, where a synchronisation per graph would make the host wait
    for every eager forward in turn (the largest buckets' take milliseconds each). The graphs' memory
    comes from their own pool, never from blocks the eager work frees. Whoever captures many graphs
    empties the cache once before them (runner.py), as a first capture through torch.cuda.graph would."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(capture_stream()):
            graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()
    finally:
        if enabled:
            gc.enable()


def graph_pool_bytes(pool: tuple[int, int]) -> int:
    """Bytes of the allocator's segments that belong to the graph memory pool `pool`. (A difference of
    memory_reserved around the capture undercounts it: each capture first empties the allocator's cache,
    which gives back as much as small graphs take.)"""
    want = tuple(pool)
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == want)
