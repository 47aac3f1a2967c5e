"""The scheduler's own Prometheus series: queue, KV and adapter-pool gauges read at scrape time, and the
counters the actor and the adapter lifecycle bump. Owns no sockets or queues."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from proto.plan import BatchPlan
from runtime.base.metrics import StageMetrics
from stages.scheduler.gateway_metrics import RUNNING_REQUESTS, WAITING_REQUESTS
from stages.scheduler.host_table import HostTable
from stages.scheduler.planner import Planner

TIERS = ("gpu", "loading", "host", "disk")  # where an adapter is, fastest first
WAITING_TIERS = ("base", "gpu", "loading", "host", "asked", "disk")  # where a waiting request's adapter is
HOLD_STATES = ("copies", "writes")  # holds on host blocks: pool copies reading them, writes outstanding
# 1 ms .. 64 s, four buckets per doubling: fine enough to read a P99 off the histogram within ~19%
WAIT_BUCKETS = [1e-3 * 2 ** (i / 4) for i in range(65)]
QUANTILES = (0.5, 0.9, 0.99)
RECENT_WAITS = 4096  # admissions the quantile gauges look back over


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


class SchedulerMetrics:
    """Gauges read through `planner` (None until the worker has started), `early_requests` (requests
    held before that), `tier_counts`, `waiting_tiers` and `hold_counts`, all called only at scrape time."""

    def __init__(
        self,
        m: StageMetrics,
        planner: Callable[[], Planner | None],
        early_requests: Callable[[], int],
        tier_counts: Callable[[], dict[str, int]],
        waiting_tiers: Callable[[], dict[str, int]],
        hold_counts: Callable[[], dict[str, int]],
    ) -> None:
        m.gauge(WAITING_REQUESTS, "Requests waiting for admission").set_function(
            lambda: len(planner().waiting) if planner() else early_requests()
        )
        m.gauge(RUNNING_REQUESTS, "Requests in the running batch").set_function(
            lambda: len(planner().running) if planner() else 0
        )
        m.gauge("lorapipe_kv_pages_used", "KV pages allocated").set_function(
            lambda: planner().pages.num_used if planner() else 0
        )
        m.gauge("lorapipe_kv_pages_free", "KV pages free").set_function(
            lambda: planner().pages.num_free if planner() else 0
        )
        m.gauge("lorapipe_slot_refs", "Running requests referencing pool adapters").set_function(
            lambda: sum(r.refs for r in planner().pool.residents.values()) if planner() else 0
        )
        self._init_pool_gauges(m, planner)
        self.plans = m.counter("lorapipe_plans", "Batch plans sent to the worker")
        self.step_adapters = m.histogram(
            "lorapipe_step_adapters",
            "Distinct adapters among the running requests of each plan (each one's weights read per step)",
            (),
            [0, 1, 2, 4, 8, 16, 32, 64, 128, 256],
        )
        self.step_adapter_bytes = m.counter(
            "lorapipe_step_adapter_bytes",
            "Bytes of the pool rows of each plan's distinct adapters, summed over plans (read once a step)",
        )
        self.slot_loads = m.counter("lorapipe_slot_loads", "Adapter copies into the GPU adapter pool issued")
        self.preemptions = m.counter("lorapipe_preemptions", "Requests preempted for KV pages")
        self.lookups = m.counter(
            "lorapipe_slot_lookups",
            "Admissions of adapter requests: adapter already resident in the GPU pool or not",
            ["result"],
        )
        self.failed = m.counter("lorapipe_requests_failed", "Requests failed by the scheduler", ["kind"])
        self._init_prefix_series(m, planner)
        m.gauge_map(
            "lorapipe_adapters_by_tier", "Registered adapters by where they are", "tier", TIERS, tier_counts
        )
        m.gauge_map(
            "lorapipe_waiting_requests_by_tier",
            "Waiting requests by where their adapter is (asked: a StageAdapter is outstanding)",
            "tier",
            WAITING_TIERS,
            waiting_tiers,
        )
        m.gauge_map(
            "lorapipe_host_holds",
            "Holds on host blocks (never evicted while held): pool copies reading them, loader writes "
            "not answered yet",
            "state",
            HOLD_STATES,
            hold_counts,
        )
        self.host_hits = m.counter(
            "lorapipe_host_cache_hits", "Adapters needed in the GPU pool whose block was in the host cache"
        )
        self.host_misses = m.counter(
            "lorapipe_host_cache_misses",
            "Adapters needed in the GPU pool whose block had to be read from disk",
        )
        self.host_evictions = m.counter("lorapipe_host_cache_evictions", "Host blocks evicted (LRU) for room")
        self.adapter_wait = m.histogram(
            "lorapipe_adapter_wait_seconds",
            "Arrival to admission of requests that waited for their adapter to load",
            (),
            WAIT_BUCKETS,
        )
        self.queue_wait = m.histogram(
            "lorapipe_request_queue_seconds",
            "Arrival at the scheduler to first admission into a plan, every request (adapter waits included)",
            (),
            WAIT_BUCKETS,
        )
        self.recent_waits: deque[float] = deque(maxlen=RECENT_WAITS)
        waits = m.gauge(
            "lorapipe_adapter_wait_quantile_seconds",
            f"Quantiles of lorapipe_adapter_wait_seconds over the last {RECENT_WAITS} such admissions",
            ["quantile"],
        )
        for q in QUANTILES:
            waits.labels(quantile=str(q)).set_function(lambda q=q: quantile(list(self.recent_waits), q))

    @staticmethod
    def host_gauges(m: StageMetrics, table: HostTable, blocks: Callable[[str], int]) -> None:
        """The host cache as the scheduler's table has it; `blocks(state)`: adapters packed in it
        (`resident`), of those being copied into the pool (`copying`), ranges being written (`writing`)."""
        g = m.gauge("lorapipe_host_cache_adapters", "Adapters in the host cache", ["state"])
        for state in ("resident", "copying", "writing"):
            g.labels(state=state).set_function(lambda state=state: blocks(state))
        m.gauge("lorapipe_host_cache_bytes_used", "Bytes of host ranges reserved").set_function(
            lambda: table.used_bytes
        )
        m.gauge("lorapipe_host_cache_capacity_bytes", "Size of the host-cache pool").set(table.capacity)
        m.gauge(
            "lorapipe_host_cache_largest_free_bytes", "Largest block placed without evicting"
        ).set_function(table.largest_free)

    def count_plan(self, running: Sequence[Any], row_bytes: Callable[[str], int] | None = None) -> None:
        """A plan was sent: count it and its distinct adapters (`running`: the planner's running requests;
        `row_bytes(name)`: the bytes of that adapter's pool rows)."""
        self.plans.inc()
        distinct = {r.adapter for r in running if r.adapter is not None}
        self.step_adapters.observe(len(distinct))
        if row_bytes is not None:
            self.step_adapter_bytes.inc(sum(row_bytes(a) for a in distinct))

    def _init_prefix_series(self, m: StageMetrics, planner: Callable[[], Planner | None]) -> None:
        """The prefix cache, under vLLM's names for its hit rate (queried and hit tokens)."""
        m.gauge("lorapipe_prefix_cache_pages", "KV pages holding a cached prompt prefix").set_function(
            lambda: planner().pages.num_cached if planner() else 0
        )
        self.prefix_queries = m.counter(
            "lorapipe_prefix_cache_queries",
            "Prompt tokens of admitted requests looked up in the prefix cache",
        )
        self.prefix_hits = m.counter(
            "lorapipe_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache"
        )
        self.prefix_evictions = m.counter(
            "lorapipe_prefix_cache_evictions", "Cached KV pages evicted (LRU) for a request's room"
        )

    @staticmethod
    def _init_pool_gauges(m: StageMetrics, planner: Callable[[], Planner | None]) -> None:
        def rows(used: bool) -> int:
            p = planner()
            return 0 if p is None else (p.pool.used_rows if used else p.cfg.pool_rows)

        def nbytes(used: bool) -> int:
            p = planner()
            return 0 if p is None else rows(used) * p.cfg.pool_row_bytes

        for state in ("used", "capacity"):
            used = state == "used"
            m.gauge(
                f"lorapipe_lora_pool_rows_{state}", f"Rank rows of the GPU adapter pool ({state})"
            ).set_function(lambda used=used: rows(used))
            m.gauge(
                f"lorapipe_lora_pool_bytes_{state}", f"Bytes of the GPU adapter pool ({state})"
            ).set_function(lambda used=used: nbytes(used))
        m.gauge("lorapipe_lora_pool_adapters", "Adapters resident in the GPU adapter pool").set_function(
            lambda: len(planner().pool.residents) if planner() else 0
        )

    def schedule(self, planner: Planner) -> BatchPlan:
        """`planner.schedule()`, counting the preemptions, pool lookups, adapter waits and queue waits it
        caused."""
        st, ps = planner.stats, planner.pages.stats
        before = (st.preemptions, st.gpu_hits, st.gpu_misses)
        cache_before = (ps.queries, ps.hits, ps.evictions)
        plan = planner.schedule()
        self.prefix_queries.inc(ps.queries - cache_before[0])
        self.prefix_hits.inc(ps.hits - cache_before[1])
        self.prefix_evictions.inc(ps.evictions - cache_before[2])
        self.preemptions.inc(st.preemptions - before[0])
        self.lookups.labels(result="hit").inc(st.gpu_hits - before[1])
        self.lookups.labels(result="miss").inc(st.gpu_misses - before[2])
        for waited in planner.adapter_waits:
            self.adapter_wait.observe(waited)
            self.recent_waits.append(waited)
        planner.adapter_waits.clear()
        for waited in planner.queue_waits:
            self.queue_wait.observe(waited)
        planner.queue_waits.clear()
        return plan
