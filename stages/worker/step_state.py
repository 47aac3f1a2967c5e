"""The worker's state of one request (its tokens, pages and slot, built from plans) and the record of a
launched step whose sampled tokens the host has not read yet (`StepExecutor.launch` → `finish`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proto.client import TokenLogprobs
from proto.plan import BatchPlan, RequestError, SlotError
from proto.sampling import SamplingParams
from stages.worker.sampler import SampledTokens
from stages.worker.slot_loads import LoadHandle

if TYPE_CHECKING:
    from stages.worker.prompt_logprobs import PromptLogprobs


@dataclass(eq=False)
class WorkerRequest:
    request_id: str
    # prompt then outputs; an output sampled by a step still in flight is a placeholder (-1 - its row in
    # that step) until the step is finished (seq_input.fill_pending resolves it on the device meanwhile)
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    slot: int
    pages: list[int]
    num_computed: int = 0
    active: bool = True  # False while preempted or once finished (until the plan says to forget it)
    # launch number of the step whose result finished or failed it: rows of later steps that were
    # launched before that result was read are dropped (the serial path never ran them)
    done_at: int | None = None
    prompt_lp_done: int = 0  # prompt positions whose prompt_logprobs were computed (a recompute skips them)
    prompt_lps: list[TokenLogprobs] | None = None  # computed, not sent yet (they go with the first token)

    def end(self, launch: int) -> None:
        self.active = False
        if self.done_at is None:
            self.done_at = launch

    def dropped_from(self, launch: int) -> bool:
        """Whether its row in step `launch` is dropped: an earlier step's result ended it."""
        return self.done_at is not None and self.done_at < launch


@dataclass(eq=False)
class InFlightStep:
    """A step issued to the device: its plan applied, its forward and sampling queued, each sampled row's
    token a placeholder in its request's list at `rows[i]` = (request, index) until `finish` reads it."""

    plan: BatchPlan
    launch: int  # the executor's launch counter (plans' step numbers are the scheduler's)
    started: float = field(default_factory=time.perf_counter)
    scheduled: list[tuple[WorkerRequest, int]] = field(default_factory=list)  # (request, tokens computed)
    rows: list[tuple[WorkerRequest, int]] = field(default_factory=list)
    sampled: SampledTokens | None = None
    errors: list[RequestError] = field(default_factory=list)
    slots_ready: list[int] = field(default_factory=list)  # synchronous loads, reported with this step
    slot_errors: list[SlotError] = field(default_factory=list)
    waited: list[LoadHandle] = field(default_factory=list)  # synchronous loads this step waited for
    prompt_lps: PromptLogprobs | None = None  # of the scheduled requests that ask

    def ready(self) -> bool:
        """Whether `finish` would not block (its tokens are on the host)."""
        return self.sampled is None or self.sampled.ready()

    def wait(self) -> None:
        """Block until `finish` would not block (called off the step thread by the actor)."""
        if self.sampled is not None:
            self.sampled.wait()
