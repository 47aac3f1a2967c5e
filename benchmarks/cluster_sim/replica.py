"""One simulated lorapipe server: a waiting queue, a running batch stepped by the measured decode and
prefill costs, a GPU adapter pool and a host cache (LRU, in bytes), one disk→host loader and the
host→GPU copy. A request is admitted once its adapter is in the GPU pool; an adapter is evicted only
when no queued-and-ready or running request uses it. Time is in seconds."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.cluster_sim.engine import Cluster


@dataclass(slots=True)
class Request:
    rid: int
    arrival: float
    adapter: int | None  # adapter index; None: the base model
    prompt: int
    output: int
    replica: int = -1
    first_token: float = -1.0
    done: float = -1.0


@dataclass
class ReplicaStats:
    tokens: int = 0  # output tokens of steps ending inside the measured window
    idle_s: float = 0.0  # GPU idle inside the window
    stalled_s: float = 0.0  # of which requests were waiting (for adapter loads)
    disk_loads: int = 0
    gpu_loads: int = 0
    adapters_loaded: set[int] = field(default_factory=set)  # every adapter ever copied into the pool


class Replica:
    def __init__(self, idx: int, cluster: Cluster) -> None:
        self.idx = idx
        self.cluster = cluster
        self.curves = cluster.curves
        self.gpu: OrderedDict[int, bool] = OrderedDict()  # adapter -> copy finished, in LRU order
        self.gpu_used = 0.0
        self.host: OrderedDict[int, None] = OrderedDict()
        self.host_used = 0.0
        self.refs: dict[int, int] = {}  # adapter -> requests ready-queued or running on it
        self.loader_queue: deque[int] = deque()
        self.loading: set[int] = set()  # queued for or in the disk→host loader
        self.loader_busy = False
        self.pending_copy: deque[int] = deque()  # waiting for room in the GPU pool
        self.blocked: dict[int, list[Request]] = {}  # adapter -> requests waiting for its copy
        self.ready: deque[Request] = deque()
        self.running = 0
        self.running_adapters: dict[int, int] = {}
        self.active: dict[int, int] = {}  # adapter -> its waiting + running requests here
        self.outstanding = 0
        self.completions: dict[int, list[Request]] = {}
        self.step_no = 0
        self.busy = False
        self.mark = 0.0  # last time idle accounting ran
        self.stats = ReplicaStats()

    # --- arrivals --------------------------------------------------------------------------------------
    def submit(self, req: Request, now: float) -> None:
        self._account(now)  # before the queue changes: the idle time so far had no such request
        req.replica = self.idx
        self.outstanding += 1
        a = req.adapter
        if a is not None:
            self._activate(a, +1)
        if a is None or self.gpu.get(a) is True:
            self._make_ready(req)
        else:
            self.blocked.setdefault(a, []).append(req)
            self._ensure(a, now)
        if not self.busy:
            self._start_step(now)
        self.cluster.on_load_change(self.idx)

    def _activate(self, a: int, delta: int) -> None:
        n = self.active.get(a, 0) + delta
        if n:
            self.active[a] = n
        else:
            del self.active[a]
        if n == 0 or (n == delta):  # 1 -> 0 or 0 -> 1
            self.cluster.on_active_change(self.idx, a, n > 0)

    def _make_ready(self, req: Request) -> None:
        a = req.adapter
        if a is not None:
            self.refs[a] = self.refs.get(a, 0) + 1
            self.gpu.move_to_end(a)
        self.ready.append(req)

    def prewarm(self, a: int) -> None:
        """Put `a` in the host cache and the GPU pool at time 0, as a long run's LRU traffic would."""
        size = self.cluster.bytes_of(a)
        if a in self.host:
            self.host.move_to_end(a)
        else:
            while self.host and self.host_used + size > self.curves.host_cache_bytes:
                victim, _ = self.host.popitem(last=False)
                self.host_used -= self.cluster.bytes_of(victim)
            self.host[a] = None
            self.host_used += size
        if a in self.gpu:
            self.gpu.move_to_end(a)
        elif self._make_room(size):
            self.gpu[a] = True
            self.gpu_used += size
            self.cluster.on_resident_change(self.idx, a, True)

    # --- adapter movement -----------------------------------------------------------------------------
    def _ensure(self, a: int, now: float) -> None:
        if a in self.gpu or a in self.loading or a in self.pending_copy:
            return
        if a in self.host:
            self.host.move_to_end(a)
            self._copy(a, now)
            return
        self.loading.add(a)
        self.loader_queue.append(a)
        self._kick_loader(now)

    def _kick_loader(self, now: float) -> None:
        if self.loader_busy or not self.loader_queue:
            return
        a = self.loader_queue.popleft()
        self.loader_busy = True
        self.cluster.at(now + self.cluster.bytes_of(a) / self.curves.disk_to_host_bytes_s, self._disk_done, a)

    def _disk_done(self, now: float, a: int) -> None:
        self.loader_busy = False
        self.loading.discard(a)
        size = self.cluster.bytes_of(a)
        while self.host and self.host_used + size > self.curves.host_cache_bytes:
            victim, _ = self.host.popitem(last=False)
            self.host_used -= self.cluster.bytes_of(victim)
        self.host[a] = None
        self.host_used += size
        self.stats.disk_loads += 1
        self.cluster.disk_loads_in_window += self.cluster.in_window(now)
        if a in self.blocked:
            self._copy(a, now)
        self._kick_loader(now)

    def _copy(self, a: int, now: float) -> None:
        size = self.cluster.bytes_of(a)
        if not self._make_room(size):
            self.pending_copy.append(a)
            return
        self.gpu[a] = False
        self.gpu_used += size
        self.stats.gpu_loads += 1
        self.stats.adapters_loaded.add(a)
        self.cluster.on_resident_change(self.idx, a, True)
        self.cluster.at(now + size / self.curves.host_to_gpu_bytes_s, self._copy_done, a)

    def _make_room(self, need: float) -> bool:
        cap = self.curves.gpu_pool_bytes
        while self.gpu_used + need > cap:
            victim = next((v for v, ready in self.gpu.items() if ready and not self.refs.get(v)), None)
            if victim is None:
                return False
            del self.gpu[victim]
            self.gpu_used -= self.cluster.bytes_of(victim)
            self.cluster.on_resident_change(self.idx, victim, False)
        return True

    def _copy_done(self, now: float, a: int) -> None:
        if a not in self.gpu:
            return
        self._account(now)
        self.gpu[a] = True
        for req in self.blocked.pop(a, []):
            self._make_ready(req)
        if not self.busy:
            self._start_step(now)

    # --- steps ----------------------------------------------------------------------------------------
    def _start_step(self, now: float) -> None:
        admitted, prefill, budget = [], 0, self.curves.max_tokens_per_step
        while self.ready and self.running < self.curves.max_running:
            req = self.ready[0]
            if admitted and req.prompt > budget:
                break
            self.ready.popleft()
            budget -= req.prompt
            prefill += req.prompt
            admitted.append(req)
            self.running += 1
            if req.adapter is not None:
                self.running_adapters[req.adapter] = self.running_adapters.get(req.adapter, 0) + 1
            self.completions.setdefault(self.step_no + req.output - 1, []).append(req)
        self._account(now)
        if self.running == 0:
            self.busy = False
            return
        self.busy = True
        k = len(self.running_adapters)
        ms = self.cluster.step_ms[self.running][min(k, self.running)] + self.curves.prefill_ms(prefill, k > 0)
        self.cluster.at(now + ms / 1000.0, self._step_done, admitted, self.running)

    def _step_done(self, now: float, admitted: list[Request], batch: int) -> None:
        if self.cluster.in_window(now):
            self.stats.tokens += batch
        for req in admitted:
            req.first_token = now
        for req in self.completions.pop(self.step_no, ()):
            self._finish(req, now)
        self.step_no += 1
        while self.pending_copy and self._has_room(self.cluster.bytes_of(self.pending_copy[0])):
            self._copy(self.pending_copy.popleft(), now)
        self._start_step(now)
        self.cluster.on_load_change(self.idx)

    def _has_room(self, need: float) -> bool:
        free = self.curves.gpu_pool_bytes - self.gpu_used
        evictable = sum(self.cluster.bytes_of(v) for v, r in self.gpu.items() if r and not self.refs.get(v))
        return free + evictable >= need

    def _finish(self, req: Request, now: float) -> None:
        req.done = now
        self.running -= 1
        self.outstanding -= 1
        a = req.adapter
        if a is not None:
            n = self.running_adapters[a] - 1
            if n:
                self.running_adapters[a] = n
            else:
                del self.running_adapters[a]
            r = self.refs[a] - 1
            if r:
                self.refs[a] = r
            else:
                del self.refs[a]
            self._activate(a, -1)
        self.cluster.on_complete(req)

    def _account(self, now: float) -> None:
        """Idle time since the last mark (the GPU ran no step), inside the window; stalled if work waited."""
        if not self.busy:
            idle = self.cluster.window_overlap(self.mark, now)
            self.stats.idle_s += idle
            if self.outstanding > self.running:
                self.stats.stalled_s += idle
        self.mark = now

    def finish_accounting(self, now: float) -> None:
        self._account(now)
