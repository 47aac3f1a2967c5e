"""Executes batch plans on the worker: keeps each request's tokens, pages and slot, runs the forward,
samples the sequences that reached their last known token, and decides when each request stops.
A running request with no entry in a plan decodes one token. With overlapped loading a slot copy is
waited on only by a step that uses the slot, layer by layer (layer i waits for layer i's part of the
copy, so a load hides behind the compute of the very step that needs it), and reported ready once its
event has completed. Synchronous loading (the baseline) makes the step that carries a load wait for all
of it before the forward, and reports it ready with that step's result.

A step is `launch`ed (plan applied, inputs built, forward and sampling issued, the tokens' copy to the
host in flight) and later `finish`ed (tokens read, stop decisions, results). Between the two the next
plan may be launched (overlapped scheduling): a token still on the device is a placeholder in its
request's list, resolved on the device when the next step reads it; a request that the earlier step
ended has its row of the later step dropped at finish, so results equal the serial `execute`'s."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable

import torch

from proto.pipeline import TokenBatch, TokenDelta
from proto.plan import BatchPlan, FinishedRequest, RequestError, SlotError, SlotLoad, StepResult
from stages.worker import prompt_logprobs
from stages.worker.guided import GuidedMasks
from stages.worker.guided_steps import StepMasks, grammar_ends, step_masks
from stages.worker.retry_apart import execute_apart
from stages.worker.runner import ModelRunner, SeqInput, inverse_of
from stages.worker.sampler import SampledTokens, Sampler
from stages.worker.seq_input import has_placeholders
from stages.worker.slot_loads import LoadHandle, PendingLoads
from stages.worker.step_state import InFlightStep, WorkerRequest

__all__ = ["InFlightStep", "StepExecutor", "WorkerRequest"]


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
        self._waited: list[LoadHandle] = []  # synchronous loads of the step being launched
        self.sampler = Sampler(runner.device, seed)
        self.eos_ids = frozenset(runner.model_cfg.eos_token_ids)
        vocab = runner.full_cfg.vocab_size
        self.guided = GuidedMasks(runner.cfg.model_dir, vocab, sorted(self.eos_ids), runner.device)
        self.prompt_asks: set[str] = set()  # requests that asked for prompt_logprobs
        self.max_model_len = max_model_len
        self._load_adapter = load_adapter
        self.requests: dict[str, WorkerRequest] = {}
        self.retried_steps = 0  # steps whose forward failed and ran again adapter by adapter
        # a tensor-parallel rank never runs a forward again on its own: the others would not join its
        # collectives (stages/worker/tp/), so a failed forward fails the step
        self.retry_apart = runner.tp is None
        self.dropped_rows = 0  # rows computed for requests that a step launched before had ended
        self._launches = itertools.count(1)
        self._last_launch = 0
        self._unfinished: list[InFlightStep] = []  # launched, not finished: at most one when launching
        # a launched step whose sampling waits for its grammar masks, issued when the step before finishes
        self._deferred: tuple[InFlightStep, StepMasks, Callable[[], SampledTokens]] | None = None
        # Host seconds per phase of the steps that computed: plan applied, forward issued, tokens
        # sampled (issue + waiting for the GPU's tokens), results built. A per-stage metric, and where
        # a profile starts. With overlapped scheduling the wait is shorter: the next launch ran first.
        self.phase_seconds = dict.fromkeys(("plan", "forward", "sample", "results"), 0.0)

    def execute(self, plan: BatchPlan) -> tuple[StepResult, TokenBatch]:
        """The serial path: launch the step and finish it at once."""
        return self.finish(self.launch(plan))

    def launch(self, plan: BatchPlan) -> InFlightStep:
        """Apply the plan, build the inputs, issue the forward and the sampling; returns the step in
        flight. At most one earlier step may still be unfinished: its placeholder tokens are the only
        ones the inputs can hold, and they are read from its device tokens."""
        if len(self._unfinished) > 1:
            raise RuntimeError("a step is launched while two earlier ones are unfinished")
        self._issue_deferred()
        before = self._unfinished[-1].sampled if self._unfinished else None
        self._last_launch = next(self._launches)
        step = InFlightStep(plan, self._last_launch)
        step.slots_ready, step.slot_errors = self._apply_slots(plan)
        step.waited, self._waited = self._waited, []
        step.scheduled = self._apply_plan(plan, {e.slot for e in step.slot_errors}, step)
        self._unfinished.append(step)
        if not step.scheduled:
            return step
        t_plan = time.perf_counter()
        seqs = [
            SeqInput(
                req.token_ids[req.num_computed : req.num_computed + n], req.num_computed, req.pages, req.slot
            )
            for req, n in step.scheduled
        ]
        pending = before.tokens if before is not None else None
        if pending is None and has_placeholders(seqs):
            raise RuntimeError("a placeholder token without the step that samples it")
        # The sequences that reach their last known token are sampled after the forward: their grammars'
        # work goes to the masks thread first, to run while the forward is launched.
        early = [req for req, n in step.scheduled if req.num_computed + n == len(req.token_ids)]
        masks = step_masks(self.guided, early, before) if self.guided and early else None
        logits, order = self._forward(step, seqs, pending)  # [B, V], row j for scheduled[order[j]]
        t_forward = time.perf_counter()
        for req, n in step.scheduled:
            req.num_computed += n
        rows = [i for i, (req, _) in enumerate(step.scheduled) if req.num_computed == len(req.token_ids)]
        if rows:
            reqs = [step.scheduled[i][0] for i in rows]
            if masks is not None and len(reqs) != len(early):  # a forward run again apart failed some
                masks = step_masks(self.guided, reqs, before)  # their tokens are taken: masks only
            if order is not None:
                pos = inverse_of(order)
                rows_at = [pos[i] for i in rows]  # their logits rows
            else:
                rows_at = rows
            # The sampler picks each request's row out of the forward's own order: no [B, V] gather.
            picks = (
                None
                if rows_at == list(range(logits.shape[0]))
                else (rows_at, self.runner.index_uploads(rows_at))
            )
            issue = functools.partial(
                self.sampler.issue, logits, [r.request_id for r in reqs], [r.sampling for r in reqs], picks,
                prompts=lambda k: reqs[k].token_ids[: reqs[k].prompt_len],
            )  # fmt: skip
            if masks is not None and before is not None:
                # the step before is finished next, while llguidance computes the masks: then this samples
                self._deferred = (step, masks, lambda: issue(allowed=masks.allowed(logits, rows_at)))
            else:
                step.sampled = issue(allowed=masks.allowed(logits, rows_at) if masks is not None else None)
            for row, req in enumerate(reqs):
                step.rows.append((req, len(req.token_ids)))
                req.token_ids.append(-1 - row)
        ph = self.phase_seconds
        ph["plan"] += t_plan - step.started
        ph["forward"] += t_forward - t_plan
        ph["sample"] += time.perf_counter() - t_forward
        return step

    def finish(self, step: InFlightStep) -> tuple[StepResult, TokenBatch]:
        """Read the step's tokens (waits for them), decide who stops, build its result and tokens.
        Steps finish in launch order. A sampling left to this finish by the next launch is issued at its
        end, whatever happens."""
        if self._deferred is not None and self._deferred[0] is step:
            self._issue_deferred()
        try:
            return self._finish(step)
        finally:
            self._issue_deferred()

    def _issue_deferred(self) -> None:
        """Issue the sampling that a launch left to the step before's finish (its grammar masks were
        being computed on llguidance's threads meanwhile)."""
        if self._deferred is not None:
            (step, _, issue), self._deferred = self._deferred, None
            t_start = time.perf_counter()
            step.sampled = issue()
            self.phase_seconds["sample"] += time.perf_counter() - t_start

    def _finish(self, step: InFlightStep) -> tuple[StepResult, TokenBatch]:
        if not self._unfinished or self._unfinished[0] is not step:
            raise RuntimeError("steps finish in the order they were launched")
        t_start = time.perf_counter()
        tokens, bad = step.sampled.result() if step.sampled is not None else ([], {})
        logprobs = step.sampled.logprobs() if step.sampled is not None else {}
        self._unfinished.pop(0)
        t_read = time.perf_counter()
        errors = step.errors
        # rows of requests an earlier step's result ended (known only after this step was launched)
        num_tokens = sum(n for req, n in step.scheduled if not req.dropped_from(step.launch))
        finished, items = [], []
        for i, lps in step.prompt_lps.entries().items() if step.prompt_lps is not None else ():
            req = step.scheduled[i][0]
            req.prompt_lps = (req.prompt_lps or []) + lps  # sent with its first token
        guided = self.guided if self.guided else None
        asks = []  # rows whose grammar has a say: (row, request, where its token is, None)

        def emit(row: int, req: WorkerRequest, at: int, reason: str | None) -> None:
            lp = [logprobs[row]] if row in logprobs else None
            delta = TokenDelta(
                request_id=req.request_id, token_ids=[req.token_ids[at]], finish_reason=reason, logprobs=lp,
                prompt_logprobs=req.prompt_lps,
            )  # fmt: skip
            req.prompt_lps = None
            items.append(delta)
            if reason is not None:
                req.end(step.launch)
                del req.token_ids[at + 1 :]  # a later step's placeholder, if one was launched
                n_out = at + 1 - req.prompt_len
                finished.append(
                    FinishedRequest(request_id=req.request_id, reason=reason, num_output_tokens=n_out)
                )

        for row, ((req, at), tok) in enumerate(zip(step.rows, tokens, strict=True)):
            if req.dropped_from(step.launch):
                self.dropped_rows += 1
                continue
            if row in bad:  # fails alone: its batch-mates keep their tokens
                req.end(step.launch)
                del req.token_ids[at:]
                errors.append(RequestError(request_id=req.request_id, message=bad[row]))
                continue
            req.token_ids[at] = tok
            reason = self._finish_reason(req, tok, at + 1)
            if guided is not None and reason is None and req.request_id in guided:
                asks.append((row, req, at, None))
                continue
            emit(row, req, at, reason)
        for row, req, at, reason in grammar_ends(guided, asks, step.launch, errors) if asks else ():
            emit(row, req, at, reason)
        self._settle(step.waited)
        slots_ready = step.slots_ready + self.pending.poll()
        if step.scheduled:
            ph = self.phase_seconds
            ph["sample"] += t_read - t_start
            ph["results"] += time.perf_counter() - t_read
        result = StepResult(
            step=step.plan.step,
            finished=finished,
            errors=errors,
            slots_ready=slots_ready,
            slot_errors=step.slot_errors,
            num_tokens=num_tokens,
        )
        return result, TokenBatch(step=step.plan.step, items=items)

    def _forward(
        self, step: InFlightStep, seqs: list[SeqInput], pending: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int] | None]:
        """The step's logits and their order (`ModelRunner.execute_grouped`)."""
        used = {req.slot for req, _ in step.scheduled if req.slot >= 0}
        # Copies into the slots this step uses: layer i waits only for layer i's part of the copy.
        layer_waits = self.pending.layer_waits(used, self.runner.model_cfg.num_layers) if used else None
        wants = prompt_logprobs.prompt_wants(step.scheduled) if self.prompt_asks else {}
        try:
            if wants:
                logits, order, extra, spans = prompt_logprobs.forward_with_prompt_rows(
                    self.runner, seqs, layer_waits, pending, wants
                )
                step.prompt_lps = prompt_logprobs.issue(step.scheduled, wants, extra, spans)
                return logits, order
            return self.runner.execute_grouped(seqs, layer_waits, pending)
        except Exception as exc:
            if (
                wants
                or not self.retry_apart
                or (len({req.slot for req, _ in step.scheduled}) < 2 and len(step.scheduled) < 2)
            ):
                raise  # nothing to tell apart (or no rank may): the caller fails this step's requests
            self.retried_steps += 1
            return execute_apart(self.runner, step, seqs, layer_waits, pending, exc), None

    def fail_step(self, plan: BatchPlan, message: str) -> StepResult:
        """The plan's step failed (its forward, or reading its tokens): every request it ran is failed
        and forgotten, and dropped from any step launched after it. A step launched before it should be
        finished first: its tokens stand."""
        failed = [s.launch for s in self._unfinished if s.plan is plan]
        at = failed[0] if failed else self._last_launch
        self._unfinished = [s for s in self._unfinished if s.plan is not plan]
        if self._deferred is not None and self._deferred[0] not in self._unfinished:
            self._deferred[1].job.wait()  # its matchers are free again
            self._deferred = None
        ids = {r.request_id for r in plan.new_requests} | {r.request_id for r in plan.cached_requests}
        ids |= {rid for rid, r in self.requests.items() if r.active}
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                req.end(at)
            self._forget(rid)
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

    def _settle(self, waited: list[LoadHandle]) -> None:
        """Metrics of synchronous loads, once the step that waited for them is over."""
        if self.pending.on_done is not None:
            for handle in waited:
                self.pending.on_done(handle)

    def poll_loads(self) -> list[int]:
        """Slots whose copy completed since the last report (for an idle worker's SlotsReady)."""
        return self.pending.poll()

    def _apply_plan(
        self, plan: BatchPlan, bad_slots: set[int], step: InFlightStep
    ) -> list[tuple[WorkerRequest, int]]:
        """Update request state from the plan; returns (request, tokens to compute) for this step."""
        errors = step.errors
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
            self._forget(rid)
        for rid in plan.preempted_request_ids:
            req = self.requests[rid]
            req.pages, req.num_computed, req.active = [], 0, False
        for req in self.requests.values():
            if req.active and req.slot in bad_slots:
                req.end(step.launch)
                errors.append(RequestError(request_id=req.request_id, message="its adapter failed to load"))
        counts: dict[str, int] = {}
        for new in plan.new_requests:
            if new.slot in bad_slots:
                errors.append(RequestError(request_id=new.request_id, message="its adapter failed to load"))
                continue
            prompt = new.prompt_ids.tolist()
            if new.sampling.guided is not None:
                self.guided.add(new.request_id, new.sampling.guided)
            if new.sampling.prompt_logprobs is not None:
                self.prompt_asks.add(new.request_id)
            # its first num_computed_tokens tokens' KV is in its first pages already (a cached prefix)
            self.requests[new.request_id] = WorkerRequest(
                new.request_id,
                prompt,
                len(prompt),
                new.sampling,
                new.slot,
                list(new.page_ids),
                num_computed=new.num_computed_tokens,
            )
            counts[new.request_id] = new.num_scheduled_tokens
        for c in plan.cached_requests:
            req = self.requests.get(c.request_id)
            if req is None or c.slot in bad_slots and c.resumed or req.done_at is not None and c.resumed:
                continue  # failed above, or ended by a result the planner had not heard of yet
            if c.resumed:
                req.pages, req.slot, req.active = list(c.new_page_ids), c.slot, True
                req.num_computed = c.num_computed_tokens
            else:
                req.pages.extend(c.new_page_ids)
            counts[c.request_id] = c.num_scheduled_tokens
        return [(req, counts.get(rid, 1)) for rid, req in self.requests.items() if req.active]

    def _forget(self, rid: str) -> None:
        self.sampler.forget(rid)
        self.guided.forget(rid)
        self.prompt_asks.discard(rid)

    def _finish_reason(self, req: WorkerRequest, tok: int, length: int) -> str | None:
        """Why the request stops at `tok`, its `length`-th token (prompt included), if it does."""
        p = req.sampling
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if length - req.prompt_len >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None
