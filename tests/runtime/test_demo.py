"""The demo's closing lines: one line of what the server counted (labelled series filtered by label, so a
failed load is not counted as a read), and the `serve` command for the demo's own files."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from runtime.demo import summarize


def test_the_summary_is_one_line_of_counts():
    reg = CollectorRegistry()
    Counter("lorapipe_plans", "plans", ["stage"], registry=reg).labels(stage="scheduler").inc(25)
    loads = Counter("lorapipe_adapter_loads", "by result", ["stage", "result"], registry=reg)
    loads.labels(stage="loader", result="staged").inc(3)
    loads.labels(stage="loader", result="failed").inc(1)
    Counter("lorapipe_gc_pauses", "noise", ["stage"], registry=reg).labels(stage="worker").inc(9)
    text = summarize(generate_latest(reg).decode())
    assert text == "25 steps, 3 adapter reads from disk, 0 copies into the adapter pool"
