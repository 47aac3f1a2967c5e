"""Continuous batching: decides each step which requests run, how many tokens each computes, which KV
pages they get and which adapters must be in which slot. Pure CPU code; never touches a tensor."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from proto.base import TokenIds
from proto.plan import BatchPlan, CachedRequestData, NewRequestData, SlotLoad, StepResult
from proto.sampling import SamplingParams
from stages.scheduler.page_allocator import PageAllocator
from stages.scheduler.residency import Place, Residency
from stages.scheduler.slot_table import SlotTable


@dataclass(frozen=True)
class PlannerConfig:
    num_slots: int
    num_pages: int
    page_size: int
    max_running_requests: int = 64
    max_tokens_per_step: int = 2048
    max_model_len: int = 4096
    pinned_adapters: tuple[str, ...] = ()
    # A load marks its slot loading (never a victim) until the worker reports it ready; requests that
    # need it are admitted at once (the worker gates each layer on its copy). Off: the synchronous
    # baseline, where the step that carries a load waits for all of it.
    overlap_loading: bool = False
    prefetch_depth: int = 0  # waiting requests looked ahead at for slot loads (0: off)
    # Adapters smaller than this are neither marked loading nor prefetched into slots: evicting for a
    # load that cheap only churns slots (measured: 32 adapters of 11 MB in 8 slots ran 17% slower).
    overlap_min_bytes: int = 0

    def __post_init__(self):
        if self.max_model_len > self.num_pages * self.page_size:
            # One request must always fit alone, or preemption could cycle forever.
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV cache's "
                f"{self.num_pages * self.page_size} tokens; lower max_model_len or give the cache more pages"
            )
        if self.max_tokens_per_step < self.max_running_requests:
            raise ValueError(
                "max_tokens_per_step must be >= max_running_requests (every running request "
                "gets at least one token per step)"
            )


@dataclass
class PlannerStats:
    steps: int = 0
    adapter_loads: int = 0
    preemptions: int = 0
    slot_hits: int = 0  # admissions whose adapter was already in a slot
    slot_misses: int = 0  # admissions that had to load their adapter into a slot


@dataclass(eq=False)  # identity: queues are searched by `in`/`remove` every step
class PlannedRequest:
    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    num_tokens: int = 0  # prompt + outputs sampled or being sampled by steps already planned
    num_computed: int = 0  # tokens whose KV is (or is being) written
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    sent: bool = False  # the worker has its NewRequestData
    resumed: bool = False  # preempted since it was sent: the next plan replaces its pages
    arrival: float = 0.0  # when it entered the waiting queue (clock of the planner)
    waited_for_adapter: bool = False  # its adapter was not resident when it was first considered


class Planner:
    """`adapter_ready(name)` says whether an adapter not in a slot can be copied into one now (the
    pipeline: its host block is staged and held); the offline engine's host cache always can."""

    def __init__(
        self,
        cfg: PlannerConfig,
        adapter_ready: Callable[[str], bool] = lambda name: True,
        clock: Callable[[], float] = time.monotonic,
        load_bytes: Callable[[str], int] = lambda name: 0,
    ):
        """`load_bytes(name)`: the size of the copy a slot load of `name` makes (0 if unknown)."""
        self.cfg = cfg
        self.adapter_ready = adapter_ready
        self.clock = clock
        self.pages = PageAllocator(cfg.num_pages, cfg.page_size)
        self.slots = SlotTable(cfg.num_slots, cfg.pinned_adapters)
        self.residency = Residency(
            self.slots,
            adapter_ready,
            lambda name: cfg.overlap_loading and load_bytes(name) >= cfg.overlap_min_bytes,
            cfg.prefetch_depth,
        )
        self.adapter_waits: list[float] = []  # seconds admitted requests waited for their adapter
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

    def users_of(self, adapter: str) -> int:
        """Waiting and running requests that use `adapter`."""
        return sum(1 for r in self.waiting if r.adapter == adapter) + sum(
            1 for r in self.running if r.adapter == adapter
        )

    def adapters_needed(self) -> list[str]:
        """Adapters of waiting requests that are not in a slot, in queue order (what to stage next)."""
        seen: dict[str, None] = {}
        for r in self.waiting:
            if r.adapter is not None and self.slots.slot_of(r.adapter) is None:
                seen.setdefault(r.adapter)
        return list(seen)

    def slot_ready(self, slot: int) -> None:
        """The worker reports a slot's copy complete: its requests may be admitted from the next plan."""
        if 0 <= slot < len(self.slots.slots):
            self.slots.mark_ready(slot)

    def evict_adapter(self, adapter: str) -> int | None:
        """Empty the slot holding `adapter` if no running request uses it; returns that slot."""
        slot = self.slots.slot_of(adapter)
        if slot is None or self.slots.slots[slot].refs:
            return None
        self.slots.clear(slot)
        return slot

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> BatchPlan:
        """The next step's plan. Every running request runs at least one token; the rest of the token
        budget extends prefill chunks, then admits waiting requests in arrival order."""
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

        nearer: set[str] = set()  # adapters of waiting requests ahead of the one being considered
        for req in list(self.waiting):
            if len(self.running) >= self.cfg.max_running_requests or budget <= 0:
                break
            place, slot = self.residency.place(req.adapter, nearer)
            if req.adapter is not None:
                nearer.add(req.adapter)
            if place is not Place.RESIDENT and place is not Place.BASE:
                req.waited_for_adapter = True
            if place is Place.WAIT:
                continue  # its adapter is not staged yet or no slot is free: let others through
            # LOAD and LOADING run now: the worker gates each layer on that layer's copy, so the load
            # hides behind this very prefill instead of holding the request back a round trip.
            n = min(req.num_tokens - req.num_computed, budget)
            need = self.pages.pages_for(n)
            if need > self.pages.num_free:
                break  # first come, first served for memory
            if place is Place.LOAD:
                self.residency.issue(slot, req.adapter, loads)
            self._admit(req, slot)
            self._emit(req, n, self.pages.allocate(need), new, cached)
            budget -= n

        if self.cfg.prefetch_depth:
            self.residency.prefetch((r.adapter for r in self.waiting), loads)
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

    def update(self, result: StepResult) -> None:
        """Apply a step's outcome: requests the worker finished leave (their tokens were counted when
        they were scheduled, so this needs nothing else and may arrive a step late)."""
        for slot in result.slots_ready:
            self.slot_ready(slot)
        for fin in result.finished:
            req = self._by_id.get(fin.request_id)
            if req is not None:
                self._finish(req)
        for err in result.errors:
            req = self._by_id.get(err.request_id)
            if req is not None:
                self._finish(req)

    def _admit(self, req: PlannedRequest, slot: int) -> None:
        if slot >= 0:
            self.slots.acquire(slot)
            if req.waited_for_adapter:
                self.stats.slot_misses += 1
                self.adapter_waits.append(self.clock() - req.arrival)
                req.waited_for_adapter = False
            else:
                self.stats.slot_hits += 1
        req.slot = slot
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
                )
            )
            req.resumed = False
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.num_tokens += 1  # this step samples the next token (counted now so planning can overlap)

    def _preempt(self, req: PlannedRequest) -> str:
        """Drop a running request's KV (recomputed later); it goes back to the front of the queue."""
        self.stats.preemptions += 1
        self.running.remove(req)
        self.pages.free(req.pages)
        req.pages, req.num_computed = [], 0
        if req.slot >= 0:
            self.slots.release(req.slot)
            req.slot = -1
        req.resumed = req.sent
        req.arrival = self.clock()
        self.waiting.appendleft(req)
        return req.request_id

    def _finish(self, req: PlannedRequest) -> None:
        self.running.remove(req)
        self.pages.free(req.pages)
        req.pages = []
        if req.slot >= 0:
            self.slots.release(req.slot)
        del self._by_id[req.request_id]
        self._finished_ids.append(req.request_id)  # the worker forgets it with the next plan
