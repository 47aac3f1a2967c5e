"""Routing policies: random; least-loaded (fewest outstanding requests); adapter affinity by consistent
hashing with bounded load (Mirrokni et al.: walk the adapter's ring from its hash, take the first replica
below ceil(c × average load), here never below a floor of outstanding requests: a replica batches
hundreds, and at low load the plain bound would spill at 1 or 2); and the endpoint picker's scorer
(LoRA affinity from the running/waiting LoRA info gauge, queue depth, KV use, weighted as in
deploy/k8s/epp-config.yaml), optionally also crediting adapters lorapipe reports resident in the pool."""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from benchmarks.cluster_sim.engine import Cluster
    from benchmarks.cluster_sim.replica import Request

POLICIES = ("random", "least-loaded", "affinity", "epp", "epp-resident")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class RandomRouter:
    def __init__(self, n: int, seed: int) -> None:
        self.n, self.rng = n, random.Random(seed)

    def choose(self, req: Request, c: Cluster) -> int:
        return self.rng.randrange(self.n)


class LeastLoadedRouter:
    def __init__(self, n: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def choose(self, req: Request, c: Cluster) -> int:
        load = c.outstanding
        best = np.flatnonzero(load == load.min())
        return int(best[self.rng.integers(len(best))]) if len(best) > 1 else int(best[0])


class AffinityRouter:
    """Consistent hashing with bounded load; base-model requests go to the least-loaded replica.
    `decisions` keeps (adapter, chosen, cap, loads seen) when `record` is set, for tests."""

    def __init__(
        self, n: int, seed: int, c: float = 1.25, floor: int = 32, vnodes: int = 64, record: bool = False
    ) -> None:
        if c <= 1.0 or floor < 1:
            raise ValueError(f"bounded load c={c}, floor={floor}: need c > 1 and floor >= 1")
        self.n, self.c, self.floor = n, c, floor
        ring = sorted((_hash(f"replica-{i}-{v}"), i) for i in range(n) for v in range(vnodes))
        self.ring_keys = [k for k, _ in ring]
        self.ring_nodes = [i for _, i in ring]
        self.walks: dict[int, list[int]] = {}
        self.least = LeastLoadedRouter(n, seed)
        self.record = record
        self.decisions: list[tuple[int, int, int, list[int]]] = []

    def walk(self, adapter: int) -> list[int]:
        """Every replica once, in the order met walking the ring clockwise from the adapter's hash."""
        w = self.walks.get(adapter)
        if w is None:
            start = bisect.bisect(self.ring_keys, _hash(f"adapter-{adapter}"))
            seen: dict[int, None] = {}
            for j in range(len(self.ring_nodes)):
                seen.setdefault(self.ring_nodes[(start + j) % len(self.ring_nodes)], None)
                if len(seen) == self.n:
                    break
            w = self.walks[adapter] = list(seen)
        return w

    def cap(self, total_outstanding: int) -> int:
        return max(self.floor, math.ceil(self.c * (total_outstanding + 1) / self.n))

    def choose(self, req: Request, c: Cluster) -> int:
        if req.adapter is None:
            return self.least.choose(req, c)
        cap = self.cap(c.total_outstanding)
        load = c.outstanding
        for i in self.walk(req.adapter):
            if load[i] + 1 <= cap:
                if self.record:
                    self.decisions.append((req.adapter, i, cap, load.tolist()))
                return i
        raise AssertionError("bounded load: no replica under the cap (impossible for c > 1)")


class EndpointPickerRouter:
    """Score = 2 × LoRA affinity + queue score + (1 − KV use); the best score wins, ties at random.
    LoRA affinity: 1 where the LoRA info gauge lists the adapter (running or waiting there; with
    `resident`, also where lorapipe's resident gauge lists it), 0.8 where fewer than `max_lora`
    adapters are active, else 0. Queue score: (max − q) / (max − min) over replicas (1 when equal)."""

    W_LORA, W_QUEUE, W_KV = 2.0, 1.0, 1.0

    def __init__(self, n: int, seed: int, max_lora: int, max_running: int, resident: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.max_lora, self.max_running, self.resident = max_lora, max_running, resident

    def choose(self, req: Request, c: Cluster) -> int:
        queue = c.outstanding - c.running
        qmin, qmax = queue.min(), queue.max()
        qscore = (qmax - queue) / (qmax - qmin) if qmax > qmin else np.ones(len(queue))
        score = self.W_QUEUE * qscore + self.W_KV * (1.0 - c.running / self.max_running)
        if req.adapter is not None:
            lora = np.where(c.active_count < self.max_lora, 0.8, 0.0)
            holders = set(c.active_on.get(req.adapter, ()))
            if self.resident:
                holders |= c.resident_on.get(req.adapter, set())
            if holders:
                lora[list(holders)] = 1.0
            score = score + self.W_LORA * lora
        best = np.flatnonzero(score == score.max())
        return int(best[self.rng.integers(len(best))]) if len(best) > 1 else int(best[0])


def make_router(policy: str, n: int, seed: int, max_lora: int, max_running: int):
    if policy == "random":
        return RandomRouter(n, seed)
    if policy == "least-loaded":
        return LeastLoadedRouter(n, seed)
    if policy == "affinity":
        return AffinityRouter(n, seed)
    if policy in ("epp", "epp-resident"):
        return EndpointPickerRouter(n, seed, max_lora, max_running, resident=policy == "epp-resident")
    raise ValueError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
