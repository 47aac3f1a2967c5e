"""Every CUDA graph capture in the project goes through `graph_capture.recording`, which pauses Python's
automatic garbage collection while it records and leaves it as it found it (CPU; the GPU side is
test_graph_capture_gpu.py)."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

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


class _Capture:
    """Stands in for torch's capture context (this test is about the collector around it): notes whether
    automatic collection is on as the capture begins and ends, and can fail to begin or in its body."""

    seen: list = []
    fail: str | None = None  # "begin": the capture fails to begin

    def __init__(self, graph, pool=None, capture_error_mode="global"):
        self.seen.append(("mode", capture_error_mode))

    def __enter__(self):
        self.seen.append(("begin", gc.isenabled()))
        if self.fail == "begin":
            raise RuntimeError("capture failed to begin")

    def __exit__(self, *exc):
        self.seen.append(("end", gc.isenabled()))
        return False


@pytest.mark.parametrize("fail", [None, "begin", "body"])
@pytest.mark.parametrize("enabled", [True, False])
def test_collection_is_paused_for_the_capture_and_restored_after(monkeypatch, enabled, fail):
    _Capture.seen, _Capture.fail = [], fail
    monkeypatch.setattr(torch.cuda, "graph", _Capture)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        if fail is None:
            with recording(object()):
                assert not gc.isenabled()
        else:
            with pytest.raises(RuntimeError, match="capture failed|body failed"):
                with recording(object()):
                    raise RuntimeError("body failed")
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert after == enabled, "the collector was not left as it was found"
    want = [("mode", "thread_local"), ("begin", False)] + ([] if fail == "begin" else [("end", False)])
    assert _Capture.seen == want
