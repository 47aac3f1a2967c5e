"""Per-stage Prometheus metrics: one CollectorRegistry per stage process, every metric labelled `stage`.
Aggregation: the launcher sends MetricsQuery on the control channel, each stage answers MetricsReport
with its registry's exposition text, and the launcher's `/metrics` parses those texts, merges samples
of the same family (a family may appear only once in a scrape) and re-exposes them with
prometheus_client, adding `lorapipe_stage_up{stage}`. Values are live at scrape time, a restarted stage
simply reports again, and no shared files or multiprocess mode are needed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

# `_created` series would come back from the parser as separate gauge families; nobody needs them.
disable_created_metrics()

# Handler service times span a 50 µs message hop to a multi-second adapter load.
SERVICE_BUCKETS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    10,
)


class Labelled:
    """A metric with the stage label already bound: `.labels(**rest)` returns the child to update."""

    def __init__(self, metric: Any, stage: str) -> None:
        self.metric = metric
        self.stage = stage

    def labels(self, **labels: str) -> Any:
        return self.metric.labels(stage=self.stage, **labels)


class StageMetrics:
    """A stage's registry plus the metrics every actor keeps; stages declare their own through
    `counter`/`gauge`/`histogram` (the stage label is added for them)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.registry = CollectorRegistry()
        self.queue_depth = self.gauge("lorapipe_queue_depth", "Messages waiting in a stage queue", ["queue"])
        self.queue_capacity = self.gauge("lorapipe_queue_capacity", "Bound of a stage queue", ["queue"])
        self.messages_in = self.counter("lorapipe_messages_in", "Messages received", ["socket", "type"])
        self.messages_out = self.counter("lorapipe_messages_out", "Messages sent", ["socket", "type"])
        self.malformed = self.counter("lorapipe_messages_malformed", "Malformed messages dropped", ["socket"])
        self.handler_errors = self.counter("lorapipe_handler_errors", "Handler exceptions", ["queue"])
        self.service_seconds = self.histogram(
            "lorapipe_service_seconds", "Time a handler spent on one message", ["queue"], SERVICE_BUCKETS
        )

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._declare(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._declare(Gauge, name, doc, labels)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = SERVICE_BUCKETS
    ) -> Any:
        return self._declare(Histogram, name, doc, labels, buckets=tuple(buckets))

    def _declare(self, kind: type, name: str, doc: str, labels: Sequence[str], **kw: Any) -> Any:
        """Without extra labels this returns the stage's child (call .inc()/.set()/.observe() on it);
        with them, a `Labelled` whose .labels(...) takes the remaining labels."""
        metric = kind(name, doc, ["stage", *labels], registry=self.registry, **kw)
        return metric.labels(stage=self.stage) if not labels else Labelled(metric, self.stage)

    def track_queue(self, name: str, depth: Callable[[], float], capacity: int) -> None:
        """Report a queue's depth at scrape time (no bookkeeping on the hot path)."""
        self.queue_depth.labels(queue=name).set_function(depth)
        self.queue_capacity.labels(queue=name).set(capacity)

    def gauge_map(
        self, name: str, doc: str, label: str, keys: Sequence[str], values: Callable[[], Mapping[str, float]]
    ) -> None:
        """A gauge with one label beyond the stage, one series per key, all read from a single call of
        `values` per scrape (a function per child would run it once per key)."""
        self.registry.register(_GaugeMap(name, doc, ["stage", label], self.stage, tuple(keys), values))

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


@dataclass(frozen=True, eq=False)  # registered by identity
class _GaugeMap:
    """The collector behind `StageMetrics.gauge_map`."""

    name: str
    doc: str
    labels: list[str]
    stage: str
    keys: tuple[str, ...]
    values: Callable[[], Mapping[str, float]]

    def describe(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self.name, self.doc, labels=self.labels)

    def collect(self) -> Iterable[Metric]:
        now = self.values()
        family = GaugeMetricFamily(self.name, self.doc, labels=self.labels)
        for key in self.keys:
            family.add_metric([self.stage, key], now[key])
        yield family


class AggregateCollector:
    """Collector for the launcher's registry: merges the exposition texts `fetch()` returns, keyed by
    stage (None = the stage did not answer), into one family per metric name."""

    def __init__(self, fetch: Callable[[], Mapping[str, str | None]]) -> None:
        self.fetch = fetch

    def collect(self) -> Iterable[Metric]:
        texts = self.fetch()
        families: dict[str, Metric] = {}
        up = Metric("lorapipe_stage_up", "1 if the stage answered the metrics query", "gauge")
        for stage, text in texts.items():
            up.add_sample("lorapipe_stage_up", {"stage": stage}, 0.0 if text is None else 1.0)
            for fam in text_string_to_metric_families(text or ""):
                merged = families.setdefault(
                    fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit)
                )
                merged.samples.extend(fam.samples)
        yield up
        yield from families.values()


def merge_expositions(texts: Mapping[str, str | None]) -> bytes:
    """One valid Prometheus text exposition from the per-stage ones."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AggregateCollector(lambda: texts))  # type: ignore[arg-type]
    return generate_latest(registry)


def serve_metrics(port: int, fetch: Callable[[], Mapping[str, str | None]], addr: str = "127.0.0.1") -> Any:
    """Serve http://addr:port/metrics from a thread; `fetch` runs on that thread for every scrape (the
    launcher implements it by querying the stages, e.g. run_coroutine_threadsafe on its loop).
    Returns (server, thread); call server.shutdown() to stop."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AggregateCollector(fetch))  # type: ignore[arg-type]
    return start_http_server(port, addr=addr, registry=registry)
