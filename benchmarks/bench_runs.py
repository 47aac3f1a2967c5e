"""One line per serving run: the client's figures of each `tools/bench_serving.py` report (output tok/s,
TTFT P50/P99, adapter-wait P99) beside what the server's metrics counted over the run (plans, distinct
adapters per plan, summed step seconds, decode- and step-graph replays). `--strip` rewrites each report
without its per-request list (most of its size) so that a device call's results come back small.
    python -m benchmarks.bench_runs OUT/*/s2_*.json [--strip]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run_line(name: str, report: dict[str, Any]) -> str:
    s = report["summary"]
    server = report.get("server_metrics") or {}
    start, end = server.get("start") or {}, server.get("end") or {}

    def n(key: str) -> float | None:  # a counter or running sum, differenced over the run
        a, b = start.get(key), end.get(key)
        return None if a is None or b is None else b - a

    count, adapters = n("step_adapters_count"), n("step_adapters_sum")
    per_plan = adapters / count if count and adapters is not None else None
    ttft = s.get("ttft") or {}
    parts = [
        f"{_f(s.get('output_throughput'), '.0f')} tok/s",
        f"TTFT P50 {_f(ttft.get('p50'), '.3f')} P99 {_f(ttft.get('p99'), '.3f')} s",
        f"wait P99 {_f(s.get('adapter_wait_p99_s'), '.3f')} s",
        f"queue P50 {_f(s.get('queue_wait_p50_s'), '.3f')} s",
        f"plans {_f(n('plans'), '.0f')}",
        f"distinct/plan {_f(per_plan, '.1f')}",
    ]
    if n("step_seconds_sum") is not None:
        parts.append(f"step_s {n('step_seconds_sum'):.1f}")
    if n("decode_graph_replays") is not None and n("step_graph_replays") is not None:
        parts.append(f"graphs {n('decode_graph_replays'):.0f}+{n('step_graph_replays'):.0f}")
    if n("gated_step_graph_replays"):
        parts.append(f"layer-gated {n('gated_step_graph_replays'):.0f}")
    return f"{name}: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", type=Path, help="bench_serving JSON reports")
    p.add_argument("--strip", action="store_true", help="drop each report's per-request list in place")
    a = p.parse_args(argv)
    for path in a.reports:
        report = json.loads(path.read_text())
        print(run_line(f"{path.parent.name}/{path.stem}", report))
        if a.strip and "requests" in report:
            del report["requests"]
            path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
