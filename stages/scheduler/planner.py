"""Continuous batching: decides each step which requests run, how many tokens each computes, which KV
pages they get, and which adapters go where in the GPU adapter pool. Pure CPU code; never a tensor."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from proto.base import TokenIds
from proto.plan import BatchPlan, CachedRequestData, NewRequestData, SlotLoad, StepResult
from proto.sampling import SamplingParams
from stages.scheduler.admission import Admission, admission_order
from stages.scheduler.page_allocator import PageAllocator
from stages.scheduler.planner_config import PlannerConfig
from stages.scheduler.pool_table import PoolTable
from stages.scheduler.prefix_cache import adapter_key, page_hashes
from stages.scheduler.residency import Place, Residency

WAITS_KEPT = 65536  # wait samples kept until read (a plan admits at most --max-running-requests)


@dataclass
class PlannerStats:
    steps: int = 0
    adapter_loads: int = 0
    preemptions: int = 0
    gpu_hits: int = 0  # admissions whose adapter was already resident in the pool
    gpu_misses: int = 0  # admissions that had to load their adapter into the pool


@dataclass(eq=False)  # identity: queues are searched by `in`/`remove` every step
class PlannedRequest:
    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    num_tokens: int = 0  # prompt + outputs sampled or being sampled by steps already planned
    num_computed: int = 0  # tokens whose KV is (or is being) written
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # adapter id while running
    sent: bool = False  # the worker has its NewRequestData
    resumed: bool = False  # preempted since it was sent: the next plan replaces its pages
    arrival: float = 0.0  # when it entered the waiting queue (clock of the planner)
    waited_for_adapter: bool = False  # its adapter was not resident when it was first considered
    bypassed: int = 0  # steps in which a later request was admitted while its adapter was staged
    queued_step: int = 0  # the planner step at which it (re-)entered the waiting queue
    hashes: list[bytes] | None = None  # chain hash of each full prompt page (prefix caching)
    hit_pages: int = 0  # leading pages taken from the prefix cache at admission (it never writes them)
    cached_pages: int = 0  # leading pages hit or cached by it (the next one to cache follows)


class Planner:
    """`adapter_ready(name)` says whether an adapter not in the pool can be copied into it now (the
    pipeline: its host block is staged and held); the offline engine's host cache always can.
    `adapter_rows(name)`: its rank rows in the pool (its largest rank; known once staged)."""

    def __init__(
        self,
        cfg: PlannerConfig,
        adapter_rows: Callable[[str], int],
        adapter_ready: Callable[[str], bool] = lambda name: True,
        clock: Callable[[], float] = time.monotonic,
        load_bytes: Callable[[str], int] = lambda name: 0,
        adapter_generation: Callable[[str], int] = lambda name: 0,
        pages: PageAllocator | None = None,
    ):
        """`load_bytes(name)`: the size of the copy a pool load of `name` makes (0 if unknown).
        `adapter_generation(name)`: which load of `name` its weights are (a prefix cache key's part).
        `pages`: KV pages whose cached prefixes outlive this planner (the offline engine's), else new."""
        self.cfg = cfg
        self.adapter_ready = adapter_ready
        self.adapter_generation = adapter_generation
        self.clock = clock
        self.pages = pages if pages is not None else PageAllocator(cfg.num_pages, cfg.page_size)
        if (self.pages.num_pages, self.pages.page_size) != (cfg.num_pages, cfg.page_size):
            raise ValueError("the KV pages given do not match the planner's config")
        self._to_cache: list[PlannedRequest] = []  # requests that computed prompt pages in this plan
        self.pool = PoolTable(cfg.pool_rows, cfg.pool_ids, cfg.pinned_adapters, cfg.max_lora_rank)
        self.residency = Residency(
            self.pool,
            adapter_ready,
            adapter_rows,
            lambda name: cfg.overlap_loading and load_bytes(name) >= cfg.overlap_min_bytes,
            cfg.prefetch_depth,
        )
        self.admission = Admission(self.pool, adapter_rows, cfg.max_loras_per_batch, cfg.max_adapter_bypass)
        # seconds admitted requests waited for their adapter, and from arrival to first admission (every
        # request): the scheduler's metrics drain them after each plan; bounded for callers that never do
        self.adapter_waits: deque[float] = deque(maxlen=WAITS_KEPT)
        self.queue_waits: deque[float] = deque(maxlen=WAITS_KEPT)
        self.waiting: deque[PlannedRequest] = deque()
        self.running: list[PlannedRequest] = []
        self._by_id: dict[str, PlannedRequest] = {}
        self._finished_ids: list[str] = []
        self._step = 0
        self.stats = PlannerStats()

    def add(
        self, request_id: str, prompt_ids: list[int], adapter: str | None, sampling: SamplingParams
    ) -> None:
        if request_id in self._by_id:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.cfg.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the limit is {self.cfg.max_model_len - 1}"
            )
        req = PlannedRequest(
            request_id, list(prompt_ids), adapter, sampling, num_tokens=len(prompt_ids), arrival=self.clock()
        )
        req.queued_step = self._step
        self._by_id[request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        req = self._by_id.get(request_id)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
            del self._by_id[request_id]
            if req.sent:
                self._finished_ids.append(request_id)
        else:
            self._finish(req)
        return True

    def adapter_of(self, request_id: str) -> str | None:
        req = self._by_id.get(request_id)
        return None if req is None else req.adapter

    def users_of(self, adapter: str) -> int:
        """Waiting and running requests that use `adapter`."""
        return sum(1 for r in self.waiting if r.adapter == adapter) + sum(
            1 for r in self.running if r.adapter == adapter
        )

    def adapter_row_bytes(self, adapter: str) -> int:
        """Bytes of the pool rows `adapter` holds (0 when not resident): what a step using it reads."""
        res = self.pool.get(adapter)
        return 0 if res is None else res.rows * self.cfg.pool_row_bytes

    def adapters_needed(self) -> list[str]:
        """Adapters of waiting requests that are not resident, in queue order (what to stage next)."""
        seen: dict[str, None] = {}
        for r in self.waiting:
            if r.adapter is not None and self.pool.get(r.adapter) is None:
                seen.setdefault(r.adapter)
        return list(seen)

    def lora_ready(self, lora_id: int) -> None:
        """The worker reports an id's copy complete: it may be evicted again once unreferenced."""
        self.pool.mark_ready(lora_id)

    def evict_adapter(self, adapter: str) -> int | None:
        """Free `adapter`'s rows and id if no running request uses it; returns that id."""
        res = self.pool.get(adapter)
        if res is None or res.refs:
            return None
        return self.pool.evict(adapter)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> BatchPlan:
        """The next step's plan. Every running request runs at least one token; the rest of the token
        budget extends prefill chunks, then admits waiting requests in admission order (admission.py)."""
        self._step += 1
        self.stats.steps += 1
        budget = self.cfg.max_tokens_per_step - len(self.running)  # one token each is reserved
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        preempted: list[str] = []
        loads: list[SlotLoad] = []

        dropped: set[str] = set()  # preempted below to make room for an earlier request
        for req in list(self.running):
            if req.request_id in dropped:
                continue
            extra = min(req.num_tokens - req.num_computed - 1, budget)
            need = self.pages.pages_for(req.num_computed + 1 + extra) - len(req.pages)
            while need > self.pages.num_free and self.running[-1] is not req:
                preempted.append(self._preempt(self.running[-1]))
                dropped.add(preempted[-1])
                budget += 1
            if need > self.pages.num_free:
                preempted.append(self._preempt(req))
                budget += 1
                continue
            budget -= extra
            self._emit(req, 1 + extra, self.pages.allocate(max(need, 0)), new, cached)

        self._admit_waiting(budget, new, cached, loads)
        self._cache_computed()
        self.stats.adapter_loads = self.residency.loads_issued
        finished, self._finished_ids = self._finished_ids, []
        return BatchPlan(
            step=self._step,
            new_requests=new,
            cached_requests=cached,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            slot_loads=loads,
        )

    def _admit_waiting(self, budget: int, new: list, cached: list, loads: list[SlotLoad]) -> None:
        """Admit waiting requests in admission order (queue order, or adapter affinity within its age
        bound: `admission_order`) while the token budget, KV pages, running slots and the step's
        distinct-adapter bound allow; those whose adapter cannot be placed yet let others pass, up to
        the bypass limit (admission.py), then prefetch."""
        step_adapters = {r.adapter for r in self.running if r.adapter is not None}
        order = admission_order(self.waiting, self._step, step_adapters, self.cfg.adapter_affinity_steps)
        res = self.admission.reserve(order, self.running, self.adapter_ready)
        nearer: set[str] = set()  # adapters of waiting requests ahead of the one being considered
        ahead, admitted = True, []
        for pos, req in enumerate(order):
            if len(self.running) >= self.cfg.max_running_requests or budget <= 0:
                break
            due = res is not None and req.request_id == res.request_id
            place, lora_id = self.residency.place(req.adapter, () if due else nearer)
            if req.adapter is not None:
                nearer.add(req.adapter)
            if place is not Place.RESIDENT and place is not Place.BASE:
                req.waited_for_adapter = True
            ok = place is not Place.WAIT and self.admission.distinct_room(res, req, step_adapters)
            if due:
                ahead = False
            if not ok or not self.admission.may_pass(res, req, ahead, place is Place.LOAD):
                continue  # let others through (bounded by the bypass limit)
            # LOAD and LOADING run now: the worker gates each layer on that layer's copy, so the load
            # hides behind this very prefill instead of holding the request back a round trip.
            hits = self._cached_prefix(req)  # only the tokens after them count against the budget
            done = len(hits) * self.cfg.page_size
            n = min(req.num_tokens - done, budget)
            need = self.pages.pages_for(done + n) - len(hits)
            if need + self.pages.unreferenced(hits) > self.pages.num_free:
                break  # first come, first served for memory
            if place is Place.LOAD:
                lora_id = self.residency.issue(req.adapter, loads, () if due else nearer)
            self._admit(req, lora_id)
            if req.adapter is not None:
                step_adapters.add(req.adapter)
            self._take_hits(req, hits)
            self._emit(req, n, self.pages.allocate(need), new, cached)
            budget -= n
            admitted.append(pos)
        taken = set(admitted)
        for pos, req in enumerate(order[: admitted[-1] if admitted else 0]):
            if pos not in taken and req.adapter is not None and self._staged(req.adapter):
                req.bypassed += 1
        if self.cfg.prefetch_depth:
            # with a reservation, nothing behind the due request takes rows ahead of it
            stop = len(order) if res is None else [r.request_id for r in order].index(res.request_id) + 1
            self.residency.prefetch((r.adapter for i, r in enumerate(order[:stop]) if i not in taken), loads)

    def _cached_prefix(self, req: PlannedRequest) -> list[int]:
        """The cached pages a waiting request would start from: its prompt's full pages found in the
        cache, short of its last token (computed, so that the step has its logits and no shared page is
        written). No pages for a request that asks for its prompt's logprobs, whose every prompt position's
        logits must be computed (the pages it computes are cached all the same)."""
        if not self.cfg.prefix_caching:
            return []
        if req.hashes is None:  # the generation cannot change while a request of the adapter exists
            gen = self.adapter_generation(req.adapter) if req.adapter is not None else 0
            req.hashes = page_hashes(adapter_key(req.adapter, gen), req.prompt_ids, self.cfg.page_size)
        if req.sampling.prompt_logprobs is not None:
            return []
        return self.pages.lookup(req.hashes[: (req.num_tokens - 1) // self.cfg.page_size])

    def _take_hits(self, req: PlannedRequest, hits: list[int]) -> None:
        if not self.cfg.prefix_caching:
            return
        self.pages.acquire(hits)
        req.pages = list(hits)
        req.num_computed = len(hits) * self.cfg.page_size
        req.hit_pages = req.cached_pages = len(hits)
        self.pages.stats.queries += len(req.prompt_ids)
        self.pages.stats.hits += req.num_computed

    def _cache_computed(self) -> None:
        """Cache the full prompt pages this plan computes. Only after the plan is made: a request of the
        same plan must not read a page whose KV the same step writes."""
        to_cache, self._to_cache = self._to_cache, []
        for req in to_cache:
            full = min(req.num_computed, len(req.prompt_ids)) // self.cfg.page_size
            for i in range(req.cached_pages, min(full, len(req.pages))):
                self.pages.insert(req.hashes[i], req.pages[i], req.adapter)
            req.cached_pages = max(req.cached_pages, full)

    def _staged(self, adapter: str) -> bool:
        return self.pool.get(adapter) is not None or self.adapter_ready(adapter)

    def update(self, result: StepResult) -> None:
        """Apply a step's outcome: requests the worker finished leave (their tokens were counted when
        they were scheduled, so this needs nothing else and may arrive a step late)."""
        for lora_id in result.slots_ready:
            self.lora_ready(lora_id)
        for fin in result.finished:
            req = self._by_id.get(fin.request_id)
            if req is not None:
                self._finish(req)
        for err in result.errors:
            req = self._by_id.get(err.request_id)
            if req is not None:
                for page in req.pages[req.hit_pages :]:  # what it wrote may be wrong: no one reads it
                    self.pages.uncache(page)
                self._finish(req)

    def _admit(self, req: PlannedRequest, lora_id: int) -> None:
        if not req.sent:  # its first admission (a preempted request comes back already sent)
            self.queue_waits.append(self.clock() - req.arrival)
        if lora_id >= 0:
            self.pool.acquire(lora_id)
            if req.waited_for_adapter:
                self.stats.gpu_misses += 1
                self.adapter_waits.append(self.clock() - req.arrival)
                req.waited_for_adapter = False
            else:
                self.stats.gpu_hits += 1
        req.slot = lora_id
        req.bypassed = 0
        self.waiting.remove(req)
        self.running.append(req)

    def _emit(self, req: PlannedRequest, n: int, pages: list[int], new: list, cached: list) -> None:
        req.pages.extend(pages)
        if not req.sent:
            new.append(
                NewRequestData(
                    request_id=req.request_id,
                    prompt_ids=TokenIds.of(req.prompt_ids),
                    sampling=req.sampling,
                    slot=req.slot,
                    page_ids=list(req.pages),
                    num_computed_tokens=req.num_computed,
                    num_scheduled_tokens=n,
                )
            )
            req.sent = True
        elif req.resumed or pages or n != 1:  # a plain decode with its pages in place needs no entry
            cached.append(
                CachedRequestData(
                    request_id=req.request_id,
                    new_page_ids=list(req.pages) if req.resumed else pages,
                    num_scheduled_tokens=n,
                    resumed=req.resumed,
                    slot=req.slot if req.resumed else -1,
                    num_computed_tokens=req.num_computed if req.resumed else 0,
                )
            )
            req.resumed = False
        req.num_computed += n
        if self.cfg.prefix_caching and req.cached_pages * self.cfg.page_size < len(req.prompt_ids):
            self._to_cache.append(req)
        if req.num_computed == req.num_tokens:
            req.num_tokens += 1  # this step samples the next token (counted now so planning can overlap)

    def _preempt(self, req: PlannedRequest) -> str:
        """Drop a running request's KV (recomputed later); it goes back to the front of the queue."""
        self.stats.preemptions += 1
        self.running.remove(req)
        self.pages.free(req.pages)
        req.pages, req.num_computed, req.hit_pages, req.cached_pages = [], 0, 0, 0
        if req.slot >= 0:
            self.pool.release(req.slot)
            req.slot = -1
        req.resumed = req.sent
        req.arrival = self.clock()
        # first in the queue, and never passed for affinity
        req.queued_step = -self.cfg.adapter_affinity_steps
        self.waiting.appendleft(req)
        return req.request_id

    def _finish(self, req: PlannedRequest) -> None:
        """Its end came back; a plan made before it may have preempted it (already without pages or slot)."""
        (self.running if req in self.running else self.waiting).remove(req)
        self.pages.free(req.pages)
        req.pages = []
        if req.slot >= 0:
            self.pool.release(req.slot)
        del self._by_id[req.request_id]
        self._finished_ids.append(req.request_id)  # the worker forgets it with the next plan
