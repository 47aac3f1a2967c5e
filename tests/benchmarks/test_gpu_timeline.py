"""benchmarks/gpu_timeline.py: the busy union and idle gaps against a brute-force time grid over random
overlapping intervals (several streams, nested and touching events), and a real torch.profiler trace."""

from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest
import torch

from runtime.common.gpu_timeline import gaps, load_trace, merge, report, summarize


def _grid(intervals, start, end):
    """1-µs cells of [start, end) covered by any interval (integer endpoints)."""
    t = np.zeros(end - start, dtype=bool)
    for s, e in intervals:
        t[max(s, start) - start : max(min(e, end) - start, 0)] = True
    return t


@pytest.mark.parametrize("seed", range(20))
def test_busy_union_and_gaps_equal_a_brute_force_grid(seed):
    rng = random.Random(seed)
    ivs = []
    for _stream in range(rng.randint(1, 4)):
        t = rng.randint(0, 50)
        for _ in range(rng.randint(0, 30)):
            d = rng.randint(0, 40)
            ivs.append((t, t + d))
            t += d + rng.choice([0, 0, rng.randint(1, 60)])  # back to back, or a gap
        if ivs and rng.random() < 0.5:  # a nested event
            s, e = rng.choice(ivs)
            ivs.append((s + (e - s) // 3, e - (e - s) // 3))
    start, end = 0, max([e for _, e in ivs], default=0) + rng.randint(0, 30)
    grid = _grid(ivs, start, end)
    busy = merge(ivs)
    assert sum(e - s for s, e in busy) == grid.sum()
    assert all(a[1] < b[0] for a, b in zip(busy, busy[1:], strict=False))  # disjoint and sorted
    idle = gaps(busy, start, end)
    assert sum(e - s for s, e in idle) == (~grid).sum()
    want_gaps = int(np.count_nonzero(np.diff(np.concatenate([[1], grid.astype(int), [1]])) == -1))
    assert len(idle) == want_gaps


def test_summary_of_a_hand_made_trace():
    ev = [
        {"ph": "X", "cat": "kernel", "name": "_lora_shrink_kernel", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 5, "dur": 10},  # another stream, overlaps
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 40, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 14, "dur": 30},
        {"ph": "X", "cat": "python_function", "name": "execute", "ts": 0, "dur": 100},
    ]
    s = summarize(ev)
    assert (s["window_us"], s["device_busy_us"]) == (100, 25)
    assert s["busy_share"] == pytest.approx(0.25)
    assert s["idle_gaps"] == 2  # 15..40 and 50..100
    assert [g["us"] for g in s["largest_gaps"]] == [50, 25]
    assert s["largest_gaps"][1]["host"][0].startswith("aten::copy_")  # the shortest op across 15..40
    assert s["device_us_by_family"] == {"lora shrink": 10, "gemm": 10, "memcpy/memset": 10}
    assert s["device_us_top_kernels"] == {"_lora_shrink_kernel": 10, "nvjet_gemm": 10, "Memcpy HtoD": 10}
    assert "| `nvjet_gemm` | 0.000 | 40.0 % |" in report(s)
    assert summarize(ev, wall_us=200)["busy_share"] == pytest.approx(25 / 200)


def test_a_real_profiler_trace_reads_back(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        x = torch.randn(64, 64)
        for _ in range(3):
            x = x @ x
    plain = tmp_path / "t.json"
    prof.export_chrome_trace(str(plain))
    packed = tmp_path / "t.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    events = load_trace(packed)
    assert events == json.loads(plain.read_text())["traceEvents"]
    s = summarize(events)
    assert s["window_us"] > 0 and s["device_busy_us"] == 0 and s["busy_share"] == 0.0  # CPU only
