"""The series an inference gateway routes by (the Gateway API Inference Extension's endpoint picker):
KV usage 0-1, a LoRA info gauge in vLLM's label format, and the adapters resident in the GPU pool. Read from
the planner at scrape time; owns no sockets or queues. docs/deploy.md documents the names."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from runtime.base.metrics import StageMetrics
from stages.scheduler.planner import Planner

WAITING_REQUESTS = "lorapipe_waiting_requests"  # declared in metrics.py; named here with the rest
RUNNING_REQUESTS = "lorapipe_running_requests"
KV_USAGE = "lorapipe_kv_cache_usage"
LORA_INFO = "lorapipe_lora_requests_info"
LORA_RESIDENT = "lorapipe_lora_resident_info"
# What the endpoint picker reads, by its own names (deploy/k8s/ and docs/deploy.md use these)
EPP_METRICS = {
    "queuedRequestsSpec": WAITING_REQUESTS,
    "runningRequestsSpec": RUNNING_REQUESTS,
    "kvUsageSpec": KV_USAGE,
    "loraSpec": LORA_INFO,
}


def _names(adapters: Iterable[str | None]) -> str:
    """Adapter names, comma-separated, once each, in first-seen order (the base model is no adapter)."""
    return ",".join(dict.fromkeys(a for a in adapters if a is not None))


class GatewayCollector:
    """Info gauges whose labels change with every scrape, so they are built fresh each time. Their value
    is the scrape's Unix time: the endpoint picker keeps the series with the largest value, as vLLM
    stamps `vllm:lora_requests_info`."""

    def __init__(
        self,
        stage: str,
        planner: Callable[[], Planner | None],
        early_adapters: Callable[[], list[str | None]],
        max_lora: Callable[[], int],
    ) -> None:
        self.stage = stage
        self.planner = planner
        self.early_adapters = early_adapters
        self.max_lora = max_lora  # distinct adapters one step may use (0 until the worker has started)

    def collect(self) -> Iterator[Metric]:
        p, now = self.planner(), time.time()
        running = _names(r.adapter for r in p.running) if p else ""
        waiting = _names(r.adapter for r in p.waiting) if p else _names(self.early_adapters())
        info = GaugeMetricFamily(
            LORA_INFO,
            "LoRA adapters of running and waiting requests, and how many distinct adapters a step may use "
            "(vLLM's label format)",
            labels=["stage", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        max_lora = str(self.max_lora())
        info.add_metric([self.stage, running, waiting, max_lora], now)
        yield info
        residents = list(p.pool.residents.values()) if p else []
        resident = GaugeMetricFamily(
            LORA_RESIDENT,
            "Adapters in the GPU adapter pool: copied and ready, or still being copied",
            labels=["stage", "resident_lora_adapters", "loading_lora_adapters", "max_lora"],
        )
        ready = _names(r.adapter for r in residents if not r.loading)
        loading = _names(r.adapter for r in residents if r.loading)
        resident.add_metric([self.stage, ready, loading, max_lora], now)
        yield resident


def add_gateway_metrics(
    m: StageMetrics,
    planner: Callable[[], Planner | None],
    early_adapters: Callable[[], list[str | None]],
    max_lora: Callable[[], int],
) -> None:
    """Register the gateway series on the scheduler's registry (the waiting and running request gauges,
    WAITING_REQUESTS and RUNNING_REQUESTS, are declared in metrics.py)."""

    def usage() -> float:
        p = planner()
        if p is None:
            return 0.0
        total = p.pages.num_used + p.pages.num_free
        return p.pages.num_used / total if total else 0.0

    m.gauge(KV_USAGE, "Fraction of KV cache pages in use (0-1)").set_function(usage)
    m.registry.register(GatewayCollector(m.stage, planner, early_adapters, max_lora))  # type: ignore[arg-type]
