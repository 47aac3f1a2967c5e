"""pytest plugin (`-p capture_probe`, this folder on PYTHONPATH): logs to $OUT/$PROBE_TAG.log every Triton
compile (with whether the calling thread's stream is capturing, and the stack when it is), every CUDA
graph capture's start and end (thread, seconds, error), and each test's outcome, so that a capture that
fails can be matched to what ran inside it and beside it."""

from __future__ import annotations

import os
import threading
import time
import traceback

import torch
import triton

_LOG = open(os.path.join(os.environ.get("OUT", "."), os.environ.get("PROBE_TAG", "probe") + ".log"), "a")
_T0 = time.perf_counter()


def _w(line: str) -> None:
    _LOG.write(f"{time.perf_counter() - _T0:9.3f} [{threading.current_thread().name}] {line}\n")
    _LOG.flush()


def _ours() -> str:
    frames = [f for f in traceback.extract_stack() if "/stages/" in f.filename or "/kernels/" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-8:]))


def _hook(**kw):
    cap = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    _w(f"{'COMPILE-IN-CAPTURE' if cap else 'compile'} {str(kw.get('repr'))[:200]} by {_ours()}")
    return None


class _Graph(torch.cuda.graph):
    def __enter__(self):
        self._probe_t = time.perf_counter()
        _w(f"capture start by {_ours()}")
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        except BaseException as e:
            _w(f"capture FAILED after {time.perf_counter() - self._probe_t:.3f}s: {e!r}")
            raise
        finally:
            if exc[0] is not None:
                _w(f"capture body raised {exc[1]!r}")
            _w(f"capture end {time.perf_counter() - self._probe_t:.3f}s")


torch.cuda.graph = _Graph


def pytest_runtest_setup(item):
    triton.knobs.runtime.jit_cache_hook = _hook
    _w(f"TEST {item.nodeid}")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _w(f"RESULT {report.nodeid} {report.when} {report.outcome}")
        if report.outcome == "failed":
            _w(str(report.longrepr)[-6000:])
