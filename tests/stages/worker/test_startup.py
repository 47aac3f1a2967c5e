"""The worker's start-up timings: phases accumulate, keep their order and survive a failing phase; a
process's age counts from its start, its interpreter start-up included, and a stage's start reads on its
launcher's clock."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from stages.worker.startup import Phases, process_age, seconds_line


def test_phases_accumulate_in_order_and_time_a_failing_phase():
    phases = Phases()
    assert phases.run("b", lambda x: x + 1, 1) == 2
    phases.run("a", time.sleep, 0.05)
    with pytest.raises(ZeroDivisionError):
        phases.run("b", lambda: (time.sleep(0.05), 1 / 0))
    assert list(phases.seconds) == ["b", "a"]
    assert phases.seconds["a"] >= 0.05 and phases.seconds["b"] >= 0.05
    assert phases.line().startswith("b ") and ", a " in phases.line()
    assert phases.line() == seconds_line(phases.seconds.items())


def test_seconds_line_names_each_part_in_order_to_a_tenth():
    assert seconds_line([("plan", 0.04), ("compile", 12.345)]) == "plan 0.0 s, compile 12.3 s"
    assert seconds_line(()) == ""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process_age reads /proc")
def test_process_age_counts_from_the_process_start():
    code = "import time; time.sleep(0.5); from stages.worker.startup import process_age; print(process_age())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    elapsed = time.monotonic() - start
    age = float(out.stdout)
    assert 0.5 <= age <= elapsed + 0.02  # clock ticks: 10 ms
    assert 0 <= process_age() < 1e6


def test_phases_add_times_measured_by_the_caller_and_line_digits():
    phases = Phases()
    phases.add("x", 0.25)
    phases.run("y", lambda: None)
    phases.add("x", 0.5)
    assert list(phases.seconds) == ["x", "y"] and phases.seconds["x"] == 0.75
    assert phases.line(2).startswith("x 0.75 s, y 0.00 s")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process_age reads /proc")
def test_a_child_tells_when_it_started_on_its_parents_clock():
    """A child's start on this process's clock falls between this process's ages before and after it ran,
    and the ages of both, read from /proc, differ by it."""
    code = (
        "import os, time; from stages.worker.startup import process_age, started_after; "
        "time.sleep(0.3); print(started_after(os.getppid()), process_age(), process_age(os.getppid()))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    before = process_age()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    after = process_age()
    started, own, parent = map(float, out.stdout.split())
    assert before - 0.02 <= started <= after + 0.02  # clock ticks: 10 ms
    assert own >= 0.3 and abs(parent - own - started) < 0.03
    assert process_age(2**22 + 1) is None  # past pid_max: no such process


def test_the_worker_stage_freezes_what_its_imports_made_before_it_starts():
    """`python -m stages.worker` freezes the objects its imports made before the stage runs, so the
    collection after setup (while WorkerStarted waits) scans only what the start-up made. The stage's
    entry point is replaced here by one that reports the frozen count (nothing else runs)."""
    code = (
        "import gc, runpy, sys\n"
        "import runtime.base.actor as actor\n"
        "actor.stage_main = lambda make, config_type, argv=None: print(gc.get_freeze_count(), flush=True)\n"
        "sys.argv = ['stages.worker', 'no-config.json']\n"
        "runpy.run_module('stages.worker', run_name='__main__')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert int(out.stdout.split()[0]) > 50_000  # torch's and the worker's modules, their functions...
