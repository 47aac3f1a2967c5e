"""Server counters for bench_serving: scrapes the launcher's Prometheus `/metrics` (all stages merged),
keeps the adapter-movement counters and the adapter-wait histogram, samples them on a thread for the
timeline, and derives hit rates and adapter-wait quantiles over the run."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stages.scheduler.metrics import HOLD_STATES, WAITING_TIERS

# report key -> (family, sample labels to match); values are summed over stages and other labels.
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "adapter_loads": ("lorapipe_adapter_loads", {"result": "staged"}),  # disk → host cache
    "adapter_load_failures": ("lorapipe_adapter_loads", {"result": "failed"}),
    "bytes_loaded": ("lorapipe_adapter_load_bytes", {}),
    "host_cache_hits": ("lorapipe_host_cache_hits", {}),
    "host_cache_misses": ("lorapipe_host_cache_misses", {}),
    "slot_loads": ("lorapipe_slot_loads", {}),  # host → GPU pool copies the scheduler issued
    "slot_copies": ("lorapipe_slot_copies", {"result": "ok"}),
    "slot_hits": ("lorapipe_slot_lookups", {"result": "hit"}),  # absent until the scheduler has it
    "slot_misses": ("lorapipe_slot_lookups", {"result": "miss"}),
    "plans": ("lorapipe_plans", {}),
    "step_adapter_bytes": ("lorapipe_step_adapter_bytes", {}),  # distinct adapters' pool rows a plan
    "step_tokens": ("lorapipe_step_tokens", {}),
    "output_tokens": ("lorapipe_output_tokens", {}),
}


# timeline key -> (sample name, labels to match): gauges and histogram sums, summed like COUNTERS; they
# show where the requests and adapters stand while a run goes on (not differenced over the run)
GAUGES: dict[str, tuple[str, dict[str, str]]] = {
    "waiting": ("lorapipe_waiting_requests", {}),
    "running": ("lorapipe_running_requests", {}),
    **{f"waiting_{tier}": ("lorapipe_waiting_requests_by_tier", {"tier": tier}) for tier in WAITING_TIERS},
    **{f"holds_{st}": ("lorapipe_host_holds", {"state": st}) for st in HOLD_STATES},
    "pool_adapters": ("lorapipe_lora_pool_adapters", {}),
    "loader_writing": ("lorapipe_host_cache_adapters", {"state": "writing"}),
    "load_seconds_sum": ("lorapipe_adapter_load_seconds_sum", {}),
    "load_seconds_count": ("lorapipe_adapter_load_seconds_count", {}),
    "step_seconds_sum": ("lorapipe_step_seconds_sum", {}),
    "decode_graph_replays": ("lorapipe_decode_graph_replays", {}),
    "step_graph_replays": ("lorapipe_step_graph_replays", {}),
    "gated_step_graph_replays": ("lorapipe_gated_step_graph_replays", {}),
    # seconds the busiest host handlers spent (their difference over a run against its duration shows
    # whether a stage's event loop, rather than the GPU, limits throughput)
    "tokenizer_output_busy_s": (
        "lorapipe_service_seconds_sum",
        {"stage": "tokenizer", "queue": "token_batches"},
    ),
    "scheduler_busy_s": ("lorapipe_service_seconds_sum", {"stage": "scheduler", "queue": "events"}),
    # distinct adapters per plan, summed (over the plans counted by step_adapters_count): the adapter
    # weights every step reads
    "step_adapters_sum": ("lorapipe_step_adapters_sum", {}),
    "step_adapters_count": ("lorapipe_step_adapters_count", {}),
}

# report key -> histogram family; scraped as {upper bound: cumulative count} (summed over stages)
HISTOGRAMS: dict[str, str] = {
    "adapter_wait": "lorapipe_adapter_wait_seconds",  # arrival to admission of requests that waited
    "queue_wait": "lorapipe_request_queue_seconds",  # arrival to first admission, every request
}


def scrape(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The COUNTERS, GAUGES and HISTOGRAMS now; None for a series the server does not expose."""
    return parse(urllib.request.urlopen(url, timeout=timeout).read().decode())


def parse(text: str) -> dict[str, Any]:
    """COUNTERS, GAUGES and HISTOGRAMS out of a Prometheus text exposition."""
    values: dict[str, Any] = dict.fromkeys([*COUNTERS, *GAUGES, *HISTOGRAMS])
    samples = {}
    for key, (name, _) in GAUGES.items():
        samples.setdefault(name, []).append(key)
    wanted = {fam: [k for k, (f, _) in COUNTERS.items() if f == fam] for fam, _ in COUNTERS.values()}
    hists = {fam: key for key, fam in HISTOGRAMS.items()}
    for fam in text_string_to_metric_families(text):
        if fam.name in hists:
            buckets: dict[float, float] = {}
            for smp in fam.samples:
                if smp.name == fam.name + "_bucket":
                    le = float(smp.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + smp.value
            values[hists[fam.name]] = buckets
        for smp in fam.samples:
            for key in samples.get(smp.name, []):
                if all(smp.labels.get(k) == v for k, v in GAUGES[key][1].items()):
                    values[key] = (values[key] or 0.0) + smp.value
        for key in wanted.get(fam.name, []):
            labels = COUNTERS[key][1]
            values[key] = sum(
                s.value
                for s in fam.samples
                if s.name == fam.name + "_total" and all(s.labels.get(k) == v for k, v in labels.items())
            )
    return values


def delta(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        k: None if start.get(k) is None or end.get(k) is None else end[k] - start[k]  # type: ignore[operator]
        for k in COUNTERS
    }
    for k in HISTOGRAMS:
        a, b = start.get(k), end.get(k)
        out[k] = None if a is None or b is None else {le: b[le] - a.get(le, 0.0) for le in b}
    return out


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram ({upper bound: count}), interpolated linearly inside its
    bucket as Prometheus' histogram_quantile does; None without observations. A quantile in the +Inf
    bucket is reported as the largest finite bound (a lower bound of the truth)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def _rate(hits: float | None, misses: float | None) -> float | None:
    if hits is None or misses is None or hits + misses <= 0:
        return None
    return hits / (hits + misses)


def derive(d: dict[str, float | None], adapter_requests: int) -> dict[str, Any]:
    """Summary entries from counter deltas. The GPU-pool hit rate comes from the scheduler's
    `lorapipe_slot_lookups_total{result}` when it exists; otherwise it is estimated as
    1 - slot loads / requests with an adapter (exact unless requests were preempted and re-admitted)."""
    out: dict[str, Any] = {
        "adapter_loads": d["adapter_loads"],
        "adapter_load_failures": d["adapter_load_failures"],
        "bytes_loaded": d["bytes_loaded"],
        "host_cache_hit_rate": _rate(d["host_cache_hits"], d["host_cache_misses"]),
        "slot_loads": d["slot_loads"],
        "server_output_tokens": d["output_tokens"],
    }
    for key, count in (("adapter_wait", "adapter_waits"), ("queue_wait", "queue_waits")):
        waits = d.get(key)
        if waits:
            out[count] = waits.get(float("inf"), 0.0)
            for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
                out[f"{key}_{name}_s"] = bucket_quantile(waits, q)
    if d["slot_hits"] is not None and d["slot_misses"] is not None:
        out["gpu_slot_hit_rate"] = _rate(d["slot_hits"], d["slot_misses"])
        out["gpu_slot_hit_rate_source"] = "lorapipe_slot_lookups_total"
    elif d["slot_loads"] is not None and adapter_requests > 0:
        out["gpu_slot_hit_rate"] = min(1.0, max(0.0, 1.0 - d["slot_loads"] / adapter_requests))
        out["gpu_slot_hit_rate_source"] = "estimate: 1 - slot_loads / adapter requests"
    else:
        out["gpu_slot_hit_rate"] = None
        out["gpu_slot_hit_rate_source"] = None
    return out


class MetricsSampler:
    """Scrapes every `interval` seconds on a daemon thread; `timeline` holds {"t": seconds since
    `t0`, **counters}. Scrape failures are skipped (the run goes on)."""

    def __init__(self, url: str, interval: float, t0: float) -> None:
        self.url, self.interval, self.t0 = url, interval, t0
        self.timeline: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-sampler", daemon=True)

    def start(self) -> MetricsSampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.timeline

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic() - self.t0
            try:
                self.timeline.append({"t": round(t, 4), **scrape(self.url, timeout=max(self.interval, 1.0))})
            except OSError:
                pass
            self._stop.wait(self.interval)
