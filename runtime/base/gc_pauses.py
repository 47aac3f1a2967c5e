"""How long this process's garbage collector stops it: every collection is timed through `gc.callbacks`
into `lorapipe_gc_pause_seconds{generation}` (a stage process installs it after setup), and one that
stops the process for `warn_s` or longer is logged with its generation and what it found. A stage that
stops in a collection stops its pipeline: the worker then has no plan to launch and the GPU idles."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from runtime.base.metrics import StageMetrics

# A young collection takes microseconds; a full one over a burst's request state, tens of milliseconds.
PAUSE_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class GcPauses:
    def __init__(self, metrics: StageMetrics, log: logging.Logger, warn_s: float = 0.02) -> None:
        self.log = log
        self.warn_s = warn_s
        self._seconds = metrics.histogram(
            "lorapipe_gc_pause_seconds",
            "Time the process stood still in one garbage collection, by generation",
            ["generation"],
            PAUSE_BUCKETS,
        )
        self._children = [self._seconds.labels(generation=str(g)) for g in range(3)]
        self._started = 0.0
        self.installed = False

    def freeze(self) -> None:
        """Collect, then freeze what is left out of the collector's scans, and time every collection. The
        weights' wrappers, modules, compiled kernels and graphs live as long as the process: a full
        collection walking them would stall every step for as long as it takes."""
        gc.collect()
        gc.freeze()
        self.install()

    def thaw(self) -> None:
        """Undo `freeze` once the stage is done: frozen objects are never freed, and Triton's nanobind
        bindings print a leak warning for each object still held when the interpreter finalizes. The
        exit's collection is not a pause of serving, so it is not timed."""
        self.uninstall()
        gc.unfreeze()

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self._on_gc)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._on_gc)
            self.installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = info.get("generation", 2)
        self._children[min(max(generation, 0), 2)].observe(seconds)
        if seconds >= self.warn_s:
            self.log.warning(
                "garbage collection of generation %d stopped this process for %.1f ms (%d objects "
                "collected, %d uncollectable)",
                generation,
                seconds * 1e3,
                info.get("collected", 0),
                info.get("uncollectable", 0),
            )
