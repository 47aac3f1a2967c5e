"""The worker's step profiler (`--profile-dir`, `--profile-steps START:COUNT`) in the real step loop, serial
and overlapped: the trace it writes holds exactly the COUNT steps from the START-th launched plan (each
annotated `step N` on the CPU; on CUDA, where only device activity is traced, told apart by their kernel
counts), its log line gives the window's GPU-busy figures, and the flags are checked."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
import torch

from runtime.common.gpu_timeline import load_trace
from runtime.serve_args import DEFAULT_PROFILE_STEPS, ServeArgsError, profile_window
from stages.worker.step_profiler import StepProfiler
from tests.stages.worker.test_step_loop import WAIT_S, FakeExecutor, Harness, plan

pytestmark = pytest.mark.timeout(60)


# What the profiler traces: device activity only where there is CUDA (unannotated), host operations
# elsewhere (each launch annotated `step N`).
CUDA = torch.cuda.is_available()


class WorkingExecutor(FakeExecutor):
    """Launches do a little torch work where the profiler looks: on CUDA, plan N launches N - 9 small
    kernels, so that the trace's kernel count tells which steps it holds; elsewhere one host matmul."""

    def __init__(self):
        super().__init__()
        self.x = torch.zeros(16, device="cuda") if CUDA else None

    def launch(self, p):
        if CUDA:
            for _ in range(p.step - 9):
                self.x.add_(1)
        else:
            torch.ones(64, 64).matmul(torch.ones(64, 64))
        return super().launch(p)

    def finish(self, step):
        if CUDA:
            torch.cuda.synchronize()  # as the real executor waits for the step's tokens
        return super().finish(step)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_trace_holds_exactly_the_window(tmp_path, caplog, overlap):
    asyncio.run(_window(tmp_path, caplog, overlap))


async def _window(tmp_path, caplog, overlap: bool) -> None:
    caplog.set_level(logging.INFO, logger="test")
    profiler = StepProfiler(str(tmp_path / "prof"), start=3, count=4, log=logging.getLogger("test"))
    h = Harness(WorkingExecutor(), overlap=overlap, profiler=profiler)
    for step in range(10, 20):  # plan numbers apart from launch counts: the 4th launch is step 13
        await h.plans.put(plan(step))
    await h.close()
    assert profiler.exporter is not None
    await asyncio.get_running_loop().run_in_executor(None, profiler.exporter.join, WAIT_S)
    assert profiler.path is not None and profiler.path.name.endswith("-steps13-16.json.gz")
    events = load_trace(profiler.path)
    if CUDA:
        # Steps 13-16 launched 4 + 5 + 6 + 7 kernels. Overlapped, plan 17 (8 kernels) may be launched
        # before step 16 is finished, so inside the window; a window off by one step would hold 18 or 26.
        kernels = sum(e.get("cat") == "kernel" for e in events)
        assert kernels in ({22, 30} if overlap else {22}), f"{kernels} kernels in the trace"
    else:
        names = {e.get("name") for e in events}
        steps = sorted(
            int(m[1]) for n in names if isinstance(n, str) and (m := re.fullmatch(r"step (\d+)", n))
        )
        assert steps == [13, 14, 15, 16]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step profile ")]
    assert lines[0] == "step profile 13-16 taken; its trace is written when the worker is next idle"
    (line,) = lines[1:]
    assert re.match(r"step profile 13-16: [\d.]+ s wall, GPU busy [\d.]+ s \([\d.]+ %\), \d+ idle gaps", line)
    assert str(profiler.path) in line
    assert list((tmp_path / "prof").iterdir()) == [profiler.path]  # the plain JSON is gone


def test_a_window_never_reached_writes_nothing(tmp_path):
    asyncio.run(_never(tmp_path))


async def _never(tmp_path) -> None:
    profiler = StepProfiler(str(tmp_path / "prof"), start=50, count=4, log=logging.getLogger("test"))
    h = Harness(WorkingExecutor(), profiler=profiler)
    for step in range(5):
        await h.plans.put(plan(step))
    await h.close()
    assert profiler.exporter is None and not (tmp_path / "prof").exists()


@pytest.mark.parametrize(
    ("directory", "spec", "message"),
    [
        (None, "1:2", "--profile-steps needs --profile-dir"),
        ("d", "12", "expected START:COUNT"),
        ("d", "a:3", "expected START:COUNT"),
        ("d", "5:0", "COUNT >= 1"),
        ("d", "-1:3", "expected START:COUNT"),
    ],
)
def test_bad_windows_are_refused(directory, spec, message):
    with pytest.raises(ServeArgsError, match=message):
        profile_window(directory, spec)


def test_windows():
    assert profile_window(None, None) is None
    assert profile_window("d", None) == DEFAULT_PROFILE_STEPS
    assert profile_window("d", "0:7") == (0, 7)
