"""Every CUDA graph capture in the project goes through `graph_capture.recording`, which pauses Python's
automatic garbage collection while it records and leaves it as it found it, and records on the capture
stream without waiting for the device or emptying the allocator's cache (CPU; the GPU side is
test_graph_capture_gpu.py)."""

from __future__ import annotations

import contextlib
import gc
import re
from pathlib import Path

import pytest
import torch

from stages.worker import graph_capture
from stages.worker.graph_capture import recording

ROOT = Path(__file__).resolve().parents[3]
CAPTURE = re.compile(r"torch\.cuda\.graph\(|\.capture_begin\(")


def test_no_capture_bypasses_the_helper():
    """A capture outside `recording` could be invalidated by a collection inside it."""
    found = []
    for top in ("runtime", "stages", "kernels", "proto", "tools"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "graph_capture.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if CAPTURE.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "captures outside stages/worker/graph_capture.recording:\n" + "\n".join(found)


class _Graph:
    """Stands in for a torch.cuda.CUDAGraph (this test is about what surrounds the capture: the collector,
    the stream, no wait for the device): notes whether automatic collection is on as the capture begins
    and ends, and can fail to begin."""

    def __init__(self, seen: list, fail: str | None):
        self.seen, self.fail = seen, fail

    def capture_begin(self, *pool, capture_error_mode="global"):
        self.seen.append(("begin", gc.isenabled(), pool, capture_error_mode))
        if self.fail == "begin":
            raise RuntimeError("capture failed to begin")

    def capture_end(self):
        self.seen.append(("end", gc.isenabled()))


@pytest.mark.parametrize("fail", [None, "begin", "body"])
@pytest.mark.parametrize("enabled", [True, False])
def test_collection_is_paused_for_the_capture_and_restored_after(monkeypatch, enabled, fail):
    seen: list = []

    @contextlib.contextmanager
    def on_stream(stream):
        seen.append(("stream", stream))
        yield
        seen.append(("stream done", stream))

    monkeypatch.setattr(graph_capture, "capture_stream", lambda: "side")
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    # torch.cuda.graph waits for the device and empties the cache before each capture; recording does not
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append(("empty_cache",)))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        if fail is None:
            with recording(_Graph(seen, fail), pool=(0, 7)):
                assert not gc.isenabled()
                seen.append(("body",))
        else:
            with pytest.raises(RuntimeError, match="capture failed|body failed"):
                with recording(_Graph(seen, fail)):
                    raise RuntimeError("body failed")
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert after == enabled, "the collector was not left as it was found"
    pool = ((0, 7),) if fail is None else ()
    want = [("stream", "side"), ("begin", False, pool, "thread_local")]
    if fail is None:
        want += [("body",), ("end", False), ("stream done", "side")]
    elif fail == "body":
        want += [("end", False)]
    assert seen == want
