"""benchmarks/bench_runs.py: one line per report, the server's counters taken over the run (from a report that
tools.bench_serving's own report builder made), and --strip drops only the per-request list."""

from __future__ import annotations

import json

from benchmarks import bench_runs
from tools import bench_metrics
from tools.bench_report import make_report


def _report(tmp_path, name: str, start: dict, end: dict) -> tuple:
    d = bench_metrics.delta(start, end)
    server = {"start": start, "end": end, "delta": d, "derived": bench_metrics.derive(d, 0), "timeline": []}
    report = make_report("bench_serving", name, {}, {}, [], 2.0, server)
    path = tmp_path / "run" / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(report))
    return path, report


def test_one_line_per_run_with_counters_over_the_run(tmp_path, capsys):
    start = {"plans": 100, "step_adapters_sum": 500, "step_adapters_count": 90, "step_seconds_sum": 1.5,
             "decode_graph_replays": 40, "step_graph_replays": 7, "gated_step_graph_replays": 2}  # fmt: skip
    end = {"plans": 912, "step_adapters_sum": 500 + 62 * 800, "step_adapters_count": 890,
           "step_seconds_sum": 15.5, "decode_graph_replays": 440, "step_graph_replays": 407,
           "gated_step_graph_replays": 9}  # fmt: skip
    path, report = _report(tmp_path, "s2_mix_1", start, end)
    bench_runs.main([str(path)])
    line = capsys.readouterr().out.strip()
    s = report["summary"]
    assert line.startswith("run/s2_mix_1: ")
    assert f"{s['output_throughput']:.0f} tok/s" in line
    assert "plans 812" in line and "distinct/plan 62.0" in line and "step_s 14.0" in line
    assert "graphs 400+400" in line and "layer-gated 7" in line


def test_strip_drops_only_the_request_list(tmp_path, capsys):
    path, report = _report(tmp_path, "s2_base_2", {"plans": 0}, {"plans": 700})
    data = json.loads(path.read_text())
    data["requests"] = [{"ttft": 0.1}] * 3
    path.write_text(json.dumps(data))
    bench_runs.main([str(path), "--strip"])
    assert "plans 700" in capsys.readouterr().out
    after = json.loads(path.read_text())
    assert "requests" not in after
    assert after["summary"] == report["summary"] and after["server_metrics"] == report["server_metrics"]
