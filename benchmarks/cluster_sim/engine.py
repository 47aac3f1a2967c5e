"""The discrete-event loop over N simulated replicas: an event heap, arrivals routed by a policy, the
indexes routers read (outstanding requests, adapters active or resident per replica), and the results:
throughput inside the measured window, TTFT percentiles, adapter loads/s and the GPU-idle share."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.cluster_sim.curves import Curves
from benchmarks.cluster_sim.replica import Replica, Request


@dataclass(frozen=True)
class Result:
    policy: str
    replicas: int
    offered_req_s: float
    requests: int  # arrivals inside the window
    completed: int  # of those, finished before the drain limit
    output_tok_s: float
    ttft_p50_s: float  # inf when more than half never got a first token
    ttft_p99_s: float
    disk_loads_s: float  # disk→host loads per second, cluster-wide, inside the window
    gpu_loads: int  # host→GPU copies over the whole run
    gpu_idle_share: float  # GPU-idle time / (replicas × window)
    gpu_stalled_share: float  # of which requests were waiting (adapter loads)
    max_replicas_per_adapter: int  # the most replicas any one adapter was copied into


def quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile; inf values (never answered) sort last."""
    if not xs:
        return math.nan
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Cluster:
    def __init__(
        self,
        curves: Curves,
        n_replicas: int,
        router: Any,
        adapter_ranks: Sequence[int],
        window: tuple[float, float],
    ) -> None:
        self.curves = curves
        self.adapter_bytes = [curves.adapter_bytes(r) for r in adapter_ranks]
        self.window = window
        self.heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = 0
        self.now = 0.0
        self.outstanding = np.zeros(n_replicas, dtype=np.int64)
        self.running = np.zeros(n_replicas, dtype=np.int64)
        self.active_count = np.zeros(n_replicas, dtype=np.int64)  # distinct adapters active per replica
        self.active_on: dict[int, set[int]] = {}  # adapter -> replicas where it runs or waits
        self.resident_on: dict[int, set[int]] = {}  # adapter -> replicas whose GPU pool holds it
        self.total_outstanding = 0
        m = curves.max_running  # step_ms[batch][distinct adapters], precomputed: the hot path reads it
        self.step_ms = [[curves.decode_ms(b, k) for k in range(b + 1)] for b in range(m + 1)]
        self.replicas = [Replica(i, self) for i in range(n_replicas)]
        self.router = router
        self.done: list[Request] = []
        self.disk_loads_in_window = 0

    # --- time --------------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t < self.window[1]

    def window_overlap(self, a: float, b: float) -> float:
        return max(0.0, min(b, self.window[1]) - max(a, self.window[0]))

    def bytes_of(self, adapter: int) -> float:
        return self.adapter_bytes[adapter]

    # --- what replicas report ---------------------------------------------------------------------------
    def on_load_change(self, i: int) -> None:
        r = self.replicas[i]
        self.total_outstanding += r.outstanding - int(self.outstanding[i])
        self.outstanding[i] = r.outstanding
        self.running[i] = r.running

    def on_active_change(self, i: int, adapter: int, active: bool) -> None:
        holders = self.active_on.setdefault(adapter, set())
        if active:
            holders.add(i)
            self.active_count[i] += 1
        else:
            holders.discard(i)
            self.active_count[i] -= 1

    def on_resident_change(self, i: int, adapter: int, resident: bool) -> None:
        holders = self.resident_on.setdefault(adapter, set())
        (holders.add if resident else holders.discard)(i)

    def on_complete(self, req: Request) -> None:
        self.done.append(req)

    def prewarm(self, sample: Sequence[Request]) -> None:
        """Fill the caches as steady traffic would: route each sample request by the policy (with no
        load anywhere) and put its adapter into that replica's host cache and GPU pool, in LRU order."""
        for req in sample:
            if req.adapter is not None:
                self.replicas[self.router.choose(req, self)].prewarm(req.adapter)

    # --- the run ---------------------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], drain_limit_s: float) -> list[Request]:
        """Route each request at its arrival; run until every request is done or `drain_limit_s` after
        the last arrival. Returns the requests (unfinished ones keep first_token = -1)."""
        for req in requests:
            self.at(req.arrival, self._arrive, req)
        end = (requests[-1].arrival if requests else 0.0) + drain_limit_s
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            if t > end:
                break
            self.now = t
            fn(t, *args)
        for r in self.replicas:
            r.finish_accounting(min(self.now, self.window[1]))
        return list(requests)

    def _arrive(self, now: float, req: Request) -> None:
        i = self.router.choose(req, self)
        self.replicas[i].submit(req, now)

    def result(self, policy: str, offered: float, requests: Sequence[Request]) -> Result:
        w0, w1 = self.window
        measured = [r for r in requests if w0 <= r.arrival < w1]
        ttfts = [r.first_token - r.arrival if r.first_token >= 0 else math.inf for r in measured]
        span, n = w1 - w0, len(self.replicas)
        stats = [r.stats for r in self.replicas]
        per_adapter: dict[int, int] = {}
        for s in stats:
            for a in s.adapters_loaded:
                per_adapter[a] = per_adapter.get(a, 0) + 1
        return Result(
            policy=policy,
            replicas=n,
            offered_req_s=offered,
            requests=len(measured),
            completed=sum(r.done >= 0 for r in measured),
            output_tok_s=sum(s.tokens for s in stats) / span,
            ttft_p50_s=quantile(ttfts, 0.5),
            ttft_p99_s=quantile(ttfts, 0.99),
            disk_loads_s=self.disk_loads_in_window / span,
            gpu_loads=sum(s.gpu_loads for s in stats),
            gpu_idle_share=sum(s.idle_s for s in stats) / (n * span),
            gpu_stalled_share=sum(s.stalled_s for s in stats) / (n * span),
            max_replicas_per_adapter=max(per_adapter.values(), default=0),
        )
