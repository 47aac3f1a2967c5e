"""Executes batch plans on the worker: keeps each request's tokens, pages and slot, runs the forward,
samples the sequences that reached their last known token, and decides when each request stops.
A running request with no entry in a plan decodes one token. With overlapped loading a slot copy is
waited on only by a step that uses the slot, layer by layer (layer i waits for layer i's part of the
copy, so a load hides behind the compute of the very step that needs it), and reported ready once its
event has completed. Synchronous loading (the baseline) makes the step that carries a load wait for all
of it before the forward, and reports it ready with that step's result."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from proto.pipeline import TokenBatch, TokenDelta
from proto.plan import BatchPlan, FinishedRequest, RequestError, SlotError, SlotLoad, StepResult
from proto.sampling import SamplingParams
from stages.worker.runner import ModelRunner, SeqInput
from stages.worker.sampler import Sampler
from stages.worker.slot_loads import LoadHandle, PendingLoads


@dataclass
class WorkerRequest:
    request_id: str
    token_ids: list[int]  # prompt then outputs
    prompt_len: int
    sampling: SamplingParams
    slot: int
    pages: list[int]
    num_computed: int = 0
    active: bool = True  # False while preempted or once finished (until the plan says to forget it)


class StepExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        load_adapter: Callable[[SlotLoad], LoadHandle | None],
        max_model_len: int,
        seed: int = 0,
        overlap_loading: bool = False,
        on_load_done: Callable[[LoadHandle], None] | None = None,
    ):
        """`load_adapter` issues a slot copy and returns its handle (None: already complete)."""
        self.runner = runner
        self.overlap_loading = overlap_loading
        self.pending = PendingLoads(on_load_done)
        self._waited: list[LoadHandle] = []  # synchronous loads of the current step
        self.sampler = Sampler(runner.device, seed)
        self.eos_ids = frozenset(runner.model_cfg.eos_token_ids)
        self.max_model_len = max_model_len
        self._load_adapter = load_adapter
        self.requests: dict[str, WorkerRequest] = {}
        self.retried_steps = 0  # steps whose forward failed and ran again adapter by adapter
        # Host seconds per phase of the steps that computed: plan applied, forward issued, tokens
        # sampled (waits for the GPU), results built. A per-stage metric, and where a profile starts.
        self.phase_seconds = dict.fromkeys(("plan", "forward", "sample", "results"), 0.0)

    def execute(self, plan: BatchPlan) -> tuple[StepResult, TokenBatch]:
        t_start = time.perf_counter()
        slots_ready, slot_errors = self._apply_slots(plan)
        errors: list[RequestError] = []
        scheduled = self._apply_plan(plan, {e.slot for e in slot_errors}, errors)
        if not scheduled:
            self._settle_waited()
            slots_ready += self.pending.poll()
            return (
                StepResult(step=plan.step, slots_ready=slots_ready, slot_errors=slot_errors, errors=errors),
                TokenBatch(step=plan.step, items=[]),
            )
        t_plan = time.perf_counter()
        used = {req.slot for req, _ in scheduled if req.slot >= 0}
        # Copies into the slots this step uses: layer i waits only for layer i's part of the copy.
        layer_waits = self.pending.layer_waits(used, self.runner.model_cfg.num_layers) if used else None
        seqs = [
            SeqInput(
                req.token_ids[req.num_computed : req.num_computed + n], req.num_computed, req.pages, req.slot
            )
            for req, n in scheduled
        ]
        try:
            logits = self.runner.execute(seqs, layer_waits)  # [B, V]
        except Exception as exc:
            if len({req.slot for req, _ in scheduled}) < 2 and len(scheduled) < 2:
                raise  # nothing to tell apart: the caller fails this step's requests
            scheduled, seqs, logits = self._execute_apart(scheduled, seqs, layer_waits, exc, errors)
        t_forward = time.perf_counter()
        for req, n in scheduled:
            req.num_computed += n
        rows = [i for i, (req, _) in enumerate(scheduled) if req.num_computed == len(req.token_ids)]
        reqs = [scheduled[i][0] for i in rows]
        tokens, bad = self.sampler.sample(
            logits[rows], [r.request_id for r in reqs], [r.sampling for r in reqs]
        )
        t_sample = time.perf_counter()
        finished, items = [], []
        for row, (req, tok) in enumerate(zip(reqs, tokens, strict=True)):
            if row in bad:  # fails alone: its batch-mates keep their tokens
                req.active = False
                errors.append(RequestError(request_id=req.request_id, message=bad[row]))
                continue
            req.token_ids.append(tok)
            reason = self._finish_reason(req, tok)
            items.append(TokenDelta(request_id=req.request_id, token_ids=[tok], finish_reason=reason))
            if reason is not None:
                req.active = False
                n_out = len(req.token_ids) - req.prompt_len
                finished.append(
                    FinishedRequest(request_id=req.request_id, reason=reason, num_output_tokens=n_out)
                )
        num_tokens = sum(n for _, n in scheduled)
        t_end = time.perf_counter()
        ph = self.phase_seconds
        ph["plan"] += t_plan - t_start
        ph["forward"] += t_forward - t_plan
        ph["sample"] += t_sample - t_forward
        ph["results"] += t_end - t_sample
        self._settle_waited()
        slots_ready += self.pending.poll()
        result = StepResult(
            step=plan.step,
            finished=finished,
            errors=errors,
            slots_ready=slots_ready,
            slot_errors=slot_errors,
            num_tokens=num_tokens,
        )
        return result, TokenBatch(step=plan.step, items=items)

    def _execute_apart(
        self,
        scheduled: list[tuple[WorkerRequest, int]],
        seqs: list[SeqInput],
        layer_waits: list[list] | None,
        exc: Exception,
        errors: list[RequestError],
    ) -> tuple[list[tuple[WorkerRequest, int]], list[SeqInput], torch.Tensor]:
        """The batch's forward failed: run it again one adapter at a time (requests without one alone),
        so only the group that fails again is failed. Recomputing writes the same KV positions again,
        so the partial writes of the failed attempt are overwritten."""
        groups: dict[object, list[int]] = {}
        for i, (req, _) in enumerate(scheduled):
            groups.setdefault(req.slot if req.slot >= 0 else ("base", i), []).append(i)
        kept: list[int] = []
        parts: list[torch.Tensor] = []
        for rows in groups.values():
            try:
                parts.append(self.runner.execute([seqs[i] for i in rows], layer_waits))
            except Exception as again:
                for i in rows:
                    req = scheduled[i][0]
                    req.active = False
                    why = f"worker step failed: {type(again).__name__}: {again}"
                    errors.append(RequestError(request_id=req.request_id, message=why[:2000]))
                continue
            kept.extend(rows)
        self.retried_steps += 1
        if not parts:
            raise exc
        return [scheduled[i] for i in kept], [seqs[i] for i in kept], torch.cat(parts)

    def fail_step(self, plan: BatchPlan, message: str) -> StepResult:
        """The forward itself failed: every request this plan ran is failed and forgotten."""
        ids = {r.request_id for r in plan.new_requests} | {r.request_id for r in plan.cached_requests}
        ids |= {rid for rid, r in self.requests.items() if r.active}
        for rid in ids:
            self.requests.pop(rid, None)
            self.sampler.forget(rid)
        errors = [RequestError(request_id=rid, message=message) for rid in sorted(ids)]
        return StepResult(step=plan.step, errors=errors)

    def _apply_slots(self, plan: BatchPlan) -> tuple[list[int], list[SlotError]]:
        for slot in plan.slot_clears:
            self.runner.pool.clear(slot)
        ready, failed = [], []
        for load in plan.slot_loads:
            self.pending.discard(load.slot)
            try:
                handle = self._load_adapter(load) or LoadHandle(load.slot, load.nbytes)
            except Exception as e:  # a bad block fails the requests on that slot, not the worker
                self.runner.pool.clear(load.slot)
                failed.append(
                    SlotError(slot=load.slot, adapter=load.adapter, message=f"loading into slot: {e}")
                )
                continue
            self.pending.add(handle)
            if not self.overlap_loading:  # synchronous: this step waits for it and reports it
                self.pending.wait_for({load.slot}, self.runner.device)
                self._waited.append(self.pending.by_slot.pop(load.slot))
                ready.append(load.slot)
        return ready, failed

    def _settle_waited(self) -> None:
        """Metrics of synchronous loads, once the step that waited for them is over."""
        waited, self._waited = self._waited, []
        if self.pending.on_done is not None:
            for handle in waited:
                self.pending.on_done(handle)

    def poll_loads(self) -> list[int]:
        """Slots whose copy completed since the last report (for an idle worker's SlotsReady)."""
        return self.pending.poll()

    def _apply_plan(
        self, plan: BatchPlan, bad_slots: set[int], errors: list[RequestError]
    ) -> list[tuple[WorkerRequest, int]]:
        """Update request state from the plan; returns (request, tokens to compute) for this step."""
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
            self.sampler.forget(rid)
        for rid in plan.preempted_request_ids:
            req = self.requests[rid]
            req.pages, req.num_computed, req.active = [], 0, False
        for req in self.requests.values():
            if req.active and req.slot in bad_slots:
                req.active = False
                errors.append(RequestError(request_id=req.request_id, message="its adapter failed to load"))
        counts: dict[str, int] = {}
        for new in plan.new_requests:
            if new.slot in bad_slots:
                errors.append(RequestError(request_id=new.request_id, message="its adapter failed to load"))
                continue
            prompt = new.prompt_ids.tolist()
            self.requests[new.request_id] = WorkerRequest(
                new.request_id, prompt, len(prompt), new.sampling, new.slot, list(new.page_ids)
            )
            counts[new.request_id] = new.num_scheduled_tokens
        for c in plan.cached_requests:
            req = self.requests.get(c.request_id)
            if req is None or c.slot in bad_slots and c.resumed:
                continue  # failed above
            if c.resumed:
                req.pages, req.slot, req.active = list(c.new_page_ids), c.slot, True
            else:
                req.pages.extend(c.new_page_ids)
            counts[c.request_id] = c.num_scheduled_tokens
        return [(req, counts.get(rid, 1)) for rid, req in self.requests.items() if req.active]

    def _finish_reason(self, req: WorkerRequest, tok: int) -> str | None:
        p = req.sampling
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if len(req.token_ids) - req.prompt_len >= p.max_tokens or len(req.token_ids) >= self.max_model_len:
            return "length"
        return None
