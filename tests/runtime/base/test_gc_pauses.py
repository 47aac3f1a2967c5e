"""The collector's pauses reach the stage's metrics and, past the threshold, its log."""

from __future__ import annotations

import gc
import logging
import re

from prometheus_client.parser import text_string_to_metric_families

from runtime.base.gc_pauses import GcPauses
from runtime.base.metrics import StageMetrics


def _counts(metrics: StageMetrics) -> dict[str, float]:
    """Observations of lorapipe_gc_pause_seconds by generation, read back from the exposition text."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics.exposition()):
        for s in fam.samples:
            if s.name == "lorapipe_gc_pause_seconds_count":
                assert s.labels["stage"] == "scheduler"
                out[s.labels["generation"]] = s.value
    return out


def test_every_collection_is_timed_by_generation_and_long_ones_are_logged(caplog):
    metrics = StageMetrics("scheduler")
    pauses = GcPauses(metrics, logging.getLogger("lorapipe.test"), warn_s=0.0)  # every pause is "long"
    pauses.install()
    try:
        with caplog.at_level(logging.WARNING, logger="lorapipe.test"):
            cycles = [[] for _ in range(1000)]
            for c in cycles:
                c.append(c)  # reference cycles: only the collector frees them
            del cycles, c
            assert gc.collect(2) >= 1000
            gc.collect(0)
    finally:
        pauses.uninstall()
    counts = _counts(metrics)
    assert counts["2"] >= 1 and counts["0"] >= 1
    found = [
        int(m.group(1))
        for r in caplog.records
        if (
            m := re.search(r"generation 2 stopped this process for [\d.]+ ms \((\d+) objects", r.getMessage())
        )
    ]
    assert found and max(found) >= 1000  # the explicit full collection, with the cycles it freed


def test_uninstalled_it_times_nothing_and_installs_once():
    metrics = StageMetrics("scheduler")
    pauses = GcPauses(metrics, logging.getLogger("lorapipe.test"))
    pauses.install()
    pauses.install()
    assert gc.callbacks.count(pauses._on_gc) == 1
    pauses.uninstall()
    assert pauses._on_gc not in gc.callbacks
    gc.collect()
    assert _counts(metrics) == {"0": 0.0, "1": 0.0, "2": 0.0}
