"""The ITL-under-load workload: resident long requests at 0, loading short requests after the start
(Poisson, one adapter each), the warm-up twin with the same shapes on resident adapters, same seed → same
bytes, clear errors."""

from __future__ import annotations

import pytest

from benchmarks import itl_workload
from tools import workload as wl

RES, LOAD = ["a0", "a1"], ["b0", "b1", "b2", "b3", "b4"]


def test_layout_of_the_workload():
    reqs = itl_workload.itl_workload(RES, LOAD, resident_requests=4, loading_rate=10.0, loading_start=1.5)
    long, short = reqs[:4], reqs[4:]
    assert [r.adapter for r in long] == ["a0", "a1", "a0", "a1"] and all(r.arrival == 0 for r in long)
    assert all(r.max_tokens == 256 and r.input_len == 128 for r in long)
    assert [r.adapter for r in short] == LOAD and all(r.max_tokens == 16 for r in short)
    arrivals = [r.arrival for r in short]
    assert arrivals[0] == 1.5 and arrivals == sorted(arrivals) and arrivals[-1] > 1.5
    assert len({tuple(r.prompt_value()) for r in reqs}) == len(reqs)  # no two prompts alike


def test_warmup_twin_and_determinism(tmp_path):
    reqs = itl_workload.itl_workload(RES, LOAD, loading_requests=7)
    twin = itl_workload.itl_workload(RES, LOAD, loading_requests=7, as_resident=True)
    assert [r.adapter for r in twin[8:]] == ["a0", "a1"] * 3 + ["a0"]
    strip = [(r.arrival, r.max_tokens, r.prompt_value()) for r in reqs]
    assert strip == [(r.arrival, r.max_tokens, r.prompt_value()) for r in twin]
    for name in ("x", "y"):
        itl_workload.main(
            ["--out", str(tmp_path / f"{name}.jsonl"), "--resident", "a0,a1", "--loading", "b0,b1"]
        )
    assert (tmp_path / "x.jsonl").read_bytes() == (tmp_path / "y.jsonl").read_bytes()
    assert len(wl.read_workload(tmp_path / "x.jsonl")) == 10


def test_errors():
    with pytest.raises(ValueError, match="both resident and loading"):
        itl_workload.itl_workload(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="at least one"):
        itl_workload.itl_workload(["a"], [])
    with pytest.raises(ValueError, match="loading-rate"):
        itl_workload.itl_workload(["a"], ["b"], loading_rate=0)
    with pytest.raises(SystemExit):
        itl_workload.main(["--out", "/dev/null", "--resident", "a", "--loading", "a"])
