"""bench_metrics against a real prometheus_client exposition: counters and the adapter-wait and queue-wait
histograms parsed, differenced over a run, and quantiles within the bucket that holds the exact sample
quantile."""

from __future__ import annotations

import random
import statistics

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tools import bench_metrics

BUCKETS = [2 ** (i / 4) / 1000 for i in range(64)]  # 1 ms .. ~55 s, 4 per doubling


def _registry(name: str = "lorapipe_adapter_wait_seconds"):
    reg = CollectorRegistry()
    hist = Histogram(name, "wait", buckets=BUCKETS, registry=reg)
    loads = Counter("lorapipe_adapter_loads", "loads", ["result"], registry=reg)
    return reg, hist, loads


FAMILIES = [
    ("lorapipe_adapter_wait_seconds", "adapter_wait"),
    ("lorapipe_request_queue_seconds", "queue_wait"),
]


@pytest.mark.parametrize("family, key", FAMILIES)
def test_run_deltas_and_quantiles_match_the_samples(family, key):
    rng = random.Random(7)
    reg, hist, loads = _registry(family)
    for _ in range(500):  # before the run: must not count
        hist.observe(rng.uniform(5, 50))
    loads.labels(result="staged").inc(3)
    start = bench_metrics.parse(generate_latest(reg).decode())
    waits = [rng.lognormvariate(-2.0, 1.2) for _ in range(3000)]
    for w in waits:
        hist.observe(w)
    loads.labels(result="staged").inc(11)
    end = bench_metrics.parse(generate_latest(reg).decode())
    d = bench_metrics.delta(start, end)
    assert d["adapter_loads"] == 11
    out = bench_metrics.derive(d, adapter_requests=3000)
    assert out[f"{key}s"] == 3000
    assert not any(k.startswith("queue_wait" if key == "adapter_wait" else "adapter_wait") for k in out)
    qs = statistics.quantiles(waits, n=100, method="inclusive")
    for name, exact in (("p50", statistics.median(waits)), ("p99", qs[98])):
        got = out[f"{key}_{name}_s"]
        lo = max([b for b in BUCKETS if b < exact], default=0.0)
        hi = min(b for b in BUCKETS if b >= exact)
        assert lo <= got <= hi, f"{name}: {got} outside the bucket ({lo}, {hi}] of the exact {exact}"


def test_quantile_edge_cases():
    assert bench_metrics.bucket_quantile({}, 0.5) is None
    assert bench_metrics.bucket_quantile({1.0: 0.0, float("inf"): 0.0}, 0.5) is None
    # everything past the last finite bound: reported as that bound (a lower bound)
    assert bench_metrics.bucket_quantile({1.0: 0.0, 2.0: 0.0, float("inf"): 4.0}, 0.99) == 2.0
    # one bucket: linear inside it
    assert bench_metrics.bucket_quantile({1.0: 0.0, 2.0: 10.0, float("inf"): 10.0}, 0.5) == pytest.approx(1.5)


def test_missing_histogram_is_none():
    start = bench_metrics.parse("")
    assert start["adapter_wait"] is None and start["queue_wait"] is None
    assert bench_metrics.delta(start, start)["adapter_wait"] is None


def test_timeline_gauges_come_from_a_real_scheduler_registry():
    """The gauges kept for the timeline, read from the scheduler's own series (names and labels as the
    scheduler registers them), summed per key; absent series stay None."""
    from runtime.base.metrics import StageMetrics
    from stages.scheduler.metrics import HOLD_STATES, TIERS, WAITING_TIERS, SchedulerMetrics

    m = StageMetrics("scheduler")
    waiting = dict.fromkeys(WAITING_TIERS, 0) | {"host": 3, "disk": 5}
    holds = dict.fromkeys(HOLD_STATES, 0) | {"copies": 2, "writes": 4}
    SchedulerMetrics(
        m, lambda: None, lambda: 9, lambda: dict.fromkeys(TIERS, 0), lambda: waiting, lambda: holds
    )
    got = bench_metrics.parse(m.exposition())
    assert (got["waiting"], got["running"], got["waiting_host"], got["waiting_disk"]) == (9, 0, 3, 5)
    assert (got["holds_copies"], got["holds_writes"]) == (2, 4)
    assert got["load_seconds_sum"] is None and got["step_graph_replays"] is None  # other stages' series


def test_stage_busy_seconds_pick_their_handler():
    text = "\n".join(
        [
            "# TYPE lorapipe_service_seconds histogram",
            'lorapipe_service_seconds_sum{queue="token_batches",stage="tokenizer"} 6.5',
            'lorapipe_service_seconds_sum{queue="client_requests",stage="tokenizer"} 0.25',
            'lorapipe_service_seconds_sum{queue="events",stage="scheduler"} 0.5',
            'lorapipe_service_seconds_count{queue="events",stage="scheduler"} 7',
            "",
        ]
    )
    got = bench_metrics.parse(text)
    assert (got["tokenizer_output_busy_s"], got["scheduler_busy_s"]) == (6.5, 0.5)


def test_distinct_adapters_per_plan_from_the_scheduler_series():
    """Each counted plan adds its running requests' distinct adapters (base-only requests none) to the
    scheduler's histogram; bench_metrics keeps its sum and count."""
    from types import SimpleNamespace

    from runtime.base.metrics import StageMetrics
    from stages.scheduler.metrics import HOLD_STATES, TIERS, WAITING_TIERS, SchedulerMetrics

    m = StageMetrics("scheduler")
    zeros = [lambda keys=keys: dict.fromkeys(keys, 0) for keys in (TIERS, WAITING_TIERS, HOLD_STATES)]
    series = SchedulerMetrics(m, lambda: None, lambda: 0, *zeros)
    plans = [["a", "b", "a", None], [None, None], ["c"] * 5 + ["d", "e"]]
    row_bytes = {"a": 10, "b": 200, "c": 3000, "d": 40000, "e": 500000}
    for adapters in plans:
        series.count_plan([SimpleNamespace(adapter=a) for a in adapters], row_bytes.__getitem__)
    got = bench_metrics.parse(m.exposition())
    assert (got["plans"], got["step_adapters_count"], got["step_adapters_sum"]) == (3, 3, 2 + 0 + 3)
    assert got["step_adapter_bytes"] == 210 + 0 + 543000  # each plan's distinct adapters once
