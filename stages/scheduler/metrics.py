"""The scheduler's own Prometheus series: queue, KV and slot gauges read at scrape time, and the counters
the actor and the adapter lifecycle bump. Owns no sockets or queues."""

from __future__ import annotations

from collections.abc import Callable

from proto.plan import BatchPlan
from runtime.base.metrics import StageMetrics
from stages.scheduler.planner import Planner

TIERS = ("gpu", "loading", "host", "disk")  # where an adapter is, fastest first


class SchedulerMetrics:
    """Gauges read through `planner` (None until the worker has started), `early_requests` (requests
    held before that) and `tier_counts`, all called only at scrape time."""

    def __init__(
        self,
        m: StageMetrics,
        planner: Callable[[], Planner | None],
        early_requests: Callable[[], int],
        tier_counts: Callable[[], dict[str, int]],
    ) -> None:
        m.gauge("lorapipe_waiting_requests", "Requests waiting for admission").set_function(
            lambda: len(planner().waiting) if planner() else early_requests()
        )
        m.gauge("lorapipe_running_requests", "Requests in the running batch").set_function(
            lambda: len(planner().running) if planner() else 0
        )
        m.gauge("lorapipe_kv_pages_used", "KV pages allocated").set_function(
            lambda: planner().pages.num_used if planner() else 0
        )
        m.gauge("lorapipe_kv_pages_free", "KV pages free").set_function(
            lambda: planner().pages.num_free if planner() else 0
        )
        m.gauge("lorapipe_slot_refs", "Running requests referencing LoRA slots").set_function(
            lambda: sum(s.refs for s in planner().slots.slots) if planner() else 0
        )
        self.plans = m.counter("lorapipe_plans", "Batch plans sent to the worker")
        self.slot_loads = m.counter("lorapipe_slot_loads", "Adapter copies into GPU slots issued")
        self.preemptions = m.counter("lorapipe_preemptions", "Requests preempted for KV pages")
        self.lookups = m.counter(
            "lorapipe_slot_lookups",
            "Admissions of adapter requests: adapter already in a slot or not",
            ["result"],
        )
        self.failed = m.counter("lorapipe_requests_failed", "Requests failed by the scheduler", ["kind"])
        tiers = m.gauge("lorapipe_adapters_by_tier", "Registered adapters by where they are", ["tier"])
        for tier in TIERS:
            tiers.labels(tier=tier).set_function(lambda tier=tier: tier_counts()[tier])
        self.host_lookups = m.counter(
            "lorapipe_host_lookups",
            "Adapters needed for a slot: block already in the host cache (hit) or read from disk (miss)",
            ["result"],
        )
        self.adapter_wait = m.histogram(
            "lorapipe_adapter_wait_seconds",
            "Arrival to admission of requests that waited for their adapter to load",
            (),
            [2**i / 1e3 for i in range(16)],
        )

    def schedule(self, planner: Planner) -> BatchPlan:
        """`planner.schedule()`, counting the preemptions, slot lookups and adapter waits it caused."""
        st = planner.stats
        before = (st.preemptions, st.slot_hits, st.slot_misses)
        plan = planner.schedule()
        self.preemptions.inc(st.preemptions - before[0])
        self.lookups.labels(result="hit").inc(st.slot_hits - before[1])
        self.lookups.labels(result="miss").inc(st.slot_misses - before[2])
        for waited in planner.adapter_waits:
            self.adapter_wait.observe(waited)
        planner.adapter_waits.clear()
        return plan
