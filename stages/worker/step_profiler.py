"""A torch.profiler window over the worker's steps (`--profile-dir DIR --profile-steps START:COUNT`):
the profiler starts as the START-th plan is launched and stops once COUNT steps from it are finished
(their GPU work done). On CUDA it traces device activity only (host operations would slow the host
path it measures); without CUDA, host operations, each step's launch annotated `step N` (overlapped,
the launches of the plans after the window come before it ends and are left unannotated). The trace is
written once the worker is next idle (no step in flight, no plan queued), or at shutdown: exporting it
holds this process's GIL for seconds, which halved the throughput of a busy H100 worker. It is written
on a thread, then a process of its own (`python -m runtime.common.gpu_timeline`) compresses it to
DIR/worker-PID-stepsA-B.json.gz and sums it up for one log line with the window's GPU-busy share over the
serving run. All calls but the export run on the step thread, the one that
issues device work. A failure to profile or to write is a warning; it never touches a request."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, out_dir: str, start: int, count: int, log: logging.Logger) -> None:
        """`start`: launches before the window (0: the first plan is in it); `count`: steps in it."""
        self.out_dir, self.start, self.count, self.log = Path(out_dir), start, count, log
        self.launched = 0
        self.first_step: int | None = None  # the plan step number the window starts at
        self.prof: torch.profiler.profile | None = None
        self.t0 = 0.0
        self.done = False
        self.pending: tuple | None = None  # (profiler, wall s, first, last) of a window not written yet
        self.exporter: threading.Thread | None = None
        self.path: Path | None = None  # the trace, once written

    def launching(self, step: int) -> contextlib.AbstractContextManager:
        """Around one plan's launch: opens the window at the START-th launch; inside it, the launch is
        annotated `step N`."""
        if not self.done and self.prof is None and self.launched == self.start:
            self._begin(step)
        self.launched += 1
        if self.prof is None or self.first_step is None or step >= self.first_step + self.count:
            return contextlib.nullcontext()  # overlapped, the next launches precede the window's end
        return torch.profiler.record_function(f"step {step}")

    def finished(self, step: int) -> None:
        """Step `step`'s tokens were read (its GPU work is done); closes the window after its last."""
        if self.prof is None or self.first_step is None or step < self.first_step + self.count - 1:
            return
        prof, self.prof, self.done = self.prof, None, True
        wall = time.perf_counter() - self.t0
        try:
            prof.stop()
        except Exception:  # a profiler that failed must not take the worker with it
            self.log.warning("the step profiler failed to stop", exc_info=True)
            return
        self.pending = (prof, wall, self.first_step, step)
        self.log.info(
            "step profile %d-%d taken; its trace is written when the worker is next idle", *self.pending[2:]
        )

    def idle(self) -> None:
        """The worker has no step in flight and no plan queued: write a trace taken (exporting holds this
        process's GIL for seconds, which would slow the steps of a busy worker)."""
        if self.pending is not None:
            args, self.pending = self.pending, None
            self.exporter = threading.Thread(target=self._export, args=args, name="step-profile", daemon=True)
            self.exporter.start()

    def close(self, timeout_s: float = 120.0) -> None:
        """At shutdown: write a trace taken, or let one being written finish (it is what the run was for)."""
        self.idle()
        if self.exporter is not None:
            self.exporter.join(timeout_s)

    def _begin(self, step: int) -> None:
        # On CUDA only device activity (kernels, copies, the runtime calls that issue them): tracing every
        # host operation too slowed serving threefold on the H100, which would be measuring the profiler.
        cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
            prof.start()
        except Exception:
            self.done = True
            self.log.warning("the step profiler could not start; serving goes on unprofiled", exc_info=True)
            return
        self.prof, self.first_step, self.t0 = prof, step, time.perf_counter()
        self.log.info("profiling steps %d to %d into %s", step, step + self.count - 1, self.out_dir)

    def _export(self, prof: torch.profiler.profile, wall: float, first: int, last: int) -> None:
        t0 = time.perf_counter()
        plain = self.out_dir / f"worker-{os.getpid()}-steps{first}-{last}.json"
        try:
            prof.export_chrome_trace(str(plain))
            cmd = [sys.executable, "-m", "runtime.common.gpu_timeline", str(plain), str(wall * 1e6)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
            s = json.loads(done.stdout)
        except Exception:
            why = "the step profile of steps %d-%d could not be written"
            self.log.warning(why, first, last, exc_info=True)
            return
        self.path = plain.with_name(plain.name + ".gz")
        fams = ", ".join(f"{k} {v / 1e6:.3f} s" for k, v in list(s["device_us_by_family"].items())[:5])
        largest = s["largest_gaps"][0]["us"] / 1e3 if s["largest_gaps"] else 0.0
        self.log.info(
            "step profile %d-%d: %.3f s wall, GPU busy %.3f s (%.1f %%), %d idle gaps (largest %.2f ms); "
            "device time: %s; trace %s (written in %.1f s)",
            first, last, wall, s["device_busy_us"] / 1e6, 100 * s["busy_share"], s["idle_gaps"], largest,
            fams or "none", self.path, time.perf_counter() - t0,
        )  # fmt: skip
