"""The worker's start-up timings: phases accumulate, keep their order and survive a failing phase; a
process's age counts from its start, its interpreter start-up included."""

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
