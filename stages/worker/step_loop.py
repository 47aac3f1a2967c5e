"""The worker's step loop: takes plans from the bounded `plans` mailbox and runs them on the one step
thread. Overlapped (the default), a step is launched and finished apart: while step N runs on the
device the next plan, if one is queued, is launched first, and only then are step N's tokens read and
its results sent; with none queued, whichever comes first wins (the next plan, or step N's tokens), so
the loop never waits for a plan while a result is ready. Serial (`--no-overlap-schedule`): each step is
launched and finished at once, the path outputs are compared against."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from proto.pipeline import TokenBatch
from proto.plan import BatchPlan, StepResult
from runtime.base.actor import Mailbox
from stages.worker.executor import InFlightStep, StepExecutor
from stages.worker.step_profiler import StepProfiler


@dataclass(frozen=True)
class StepOutcome:
    """What one plan produced, to send in plan order: its result, its tokens (None for a failed step)
    and the finished step (None when its launch failed)."""

    result: StepResult
    tokens: TokenBatch | None
    step: InFlightStep | None


class StepLoop:
    def __init__(
        self,
        executor: StepExecutor,
        thread: ThreadPoolExecutor,
        plans: Mailbox[BatchPlan],
        send: Callable[[StepOutcome], Awaitable[None]],
        overlap: bool,
        log: logging.Logger,
        profiler: StepProfiler | None = None,
    ):
        """`thread`: the step thread (every device call goes through it); `send` delivers one outcome;
        `profiler`: a torch.profiler window over some steps (`--profile-steps`)."""
        self.executor, self.thread, self.plans, self.send = executor, thread, plans, send
        self.overlap = overlap
        self.log = log
        self.profiler = profiler
        # blocks on a step's token copy while the event loop waits for a plan too (never the step thread)
        self.waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-wait")
        self.busy = False  # a step is in flight or the step thread is launching or finishing one

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        in_flight: InFlightStep | None = None
        while True:
            plan = await self._next_plan(in_flight)
            self.busy = True
            in_flight, outcomes = await loop.run_in_executor(self.thread, self._advance, plan, in_flight)
            for outcome in outcomes:
                await self.send(outcome)
                self.plans.task_done()
            self.busy = in_flight is not None

    def close(self) -> None:
        self.waiter.shutdown(wait=False, cancel_futures=True)
        if self.profiler is not None:
            self.profiler.close()

    async def _next_plan(self, in_flight: InFlightStep | None) -> BatchPlan | None:
        """The plan to launch next, or None when the step in flight should be finished first: its
        tokens arrived before any plan did."""
        if in_flight is None:
            if self.profiler is not None and self.plans.empty():
                self.profiler.idle()  # nothing to run: a good time to write a trace
            return await self.plans.get()
        if not self.plans.empty():
            return self.plans.get_nowait()
        if in_flight.ready():
            return None
        get = asyncio.ensure_future(self.plans.get())
        ready = asyncio.get_running_loop().run_in_executor(self.waiter, in_flight.wait)
        await asyncio.wait((get, ready), return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()  # a cancelled get leaves its item in the queue
        try:
            return await get
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            return None

    def _advance(self, plan: BatchPlan | None, prev: InFlightStep | None) -> tuple[InFlightStep | None, list]:
        """On the step thread: launch `plan` (if any), then finish `prev` (if any), so the device has the
        new step queued before the host waits for the previous one's tokens. Returns the step left in
        flight and the outcomes to send, in plan order."""
        ex, out = self.executor, []
        step = None
        if plan is not None:
            try:
                with self.profiler.launching(plan.step) if self.profiler else contextlib.nullcontext():
                    step = ex.launch(plan)
            except Exception as e:  # the forward failed: fail this step's requests, keep serving
                self.log.exception("step %d failed", plan.step)
                if prev is not None:  # its tokens stand: finish it before failing the later step
                    out.append(self._finish(prev))
                    prev = None
                out.append(StepOutcome(ex.fail_step(plan, _failure(e)), None, None))
        if prev is not None:
            out.append(self._finish(prev))
        if step is not None and not self.overlap:
            out.append(self._finish(step))
            step = None
        return step, out

    def _finish(self, step: InFlightStep) -> StepOutcome:
        try:
            result, tokens = self.executor.finish(step)
        except Exception as e:  # reading the step's tokens failed (a device fault)
            self.log.exception("step %d failed", step.plan.step)
            return StepOutcome(self.executor.fail_step(step.plan, _failure(e)), None, None)
        if self.profiler is not None:
            self.profiler.finished(step.plan.step)
        return StepOutcome(result, tokens, step)


def _failure(e: Exception) -> str:
    return f"worker step failed: {type(e).__name__}: {e}"
