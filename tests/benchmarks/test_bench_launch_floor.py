"""bench_launch_floor's smoke run (eager on the CPU under the interpreter, graphed on a GPU): every variant
is timed, and its counters hold exactly the links launched; a chain checked against another count fails."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_launch_floor
from benchmarks.bench_launch_floor import Chain

pytestmark = pytest.mark.timeout(120)


def test_smoke_run_times_every_variant(tmp_path):
    bench_launch_floor.main([str(tmp_path), "--smoke"])
    summary = json.loads((tmp_path / "launch_floor.json").read_text())
    rows = summary["rows"]
    shapes = {(r["programs"], r["live"], r["link"]) for r in rows}
    assert shapes == {(p, live, k) for _, p, live in bench_launch_floor.SHAPES for k in ("bare", "prologue")}
    assert all(r["us_per_link"] > 0 for r in rows)
    assert "| prologue | 1,792 (448) |" in (tmp_path / "launch_floor.txt").read_text()


@pytest.mark.parametrize("prologue", [False, True])
def test_only_live_programs_count_each_link(prologue):
    chain = Chain(programs=24, live=5, prologue=prologue, pdl=False, device=torch.device("cpu"))
    chain.launch(3)
    chain.check(3)
    assert chain.acc[:5].tolist() == [3] * 5 and not chain.acc[5:].any()
    with pytest.raises(AssertionError, match="program 0's counter is 3, expected 2"):
        chain.check(2)
