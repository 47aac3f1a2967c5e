"""The worker's step loop against a stand-in executor whose steps finish when the test says: a queued
plan is launched before the step in flight is finished, a ready result is never held back waiting for a
plan, a plan that arrives while a step runs is launched before that step is read, the serial path
finishes each step before the next launch, a failed launch is reported after the step before it, and
every outcome is sent in plan order (the mailbox drains)."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from proto.plan import BatchPlan, RequestError, StepResult
from runtime.base.actor import Mailbox
from stages.worker.step_loop import StepLoop, StepOutcome

pytestmark = pytest.mark.timeout(30)
WAIT_S = 10.0  # a hard bound on each awaited condition, not a pause


class FakeStep:
    def __init__(self, plan: BatchPlan):
        self.plan = plan
        self.done = threading.Event()

    def ready(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        self.done.wait()


class FakeExecutor:
    """Records launch/finish calls; `finish` blocks until the step is done, as the real one waits for
    its tokens. Steps are done at launch unless `hold` names their plan."""

    def __init__(self, hold: set[int] = frozenset(), fail: set[int] = frozenset()):
        self.calls: list[tuple[str, int]] = []
        self.steps: dict[int, FakeStep] = {}
        self.hold, self.fail = hold, fail
        self.changed = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def _note(self, what: str, step: int) -> None:
        self.calls.append((what, step))
        self.loop.call_soon_threadsafe(self.changed.set)

    def launch(self, plan: BatchPlan) -> FakeStep:
        self._note("launch", plan.step)
        if plan.step in self.fail:
            raise RuntimeError("forward failed")
        step = self.steps[plan.step] = FakeStep(plan)
        if plan.step not in self.hold:
            step.done.set()
        return step

    def finish(self, step: FakeStep) -> tuple[StepResult, None]:
        step.wait()
        self._note("finish", step.plan.step)
        return StepResult(step=step.plan.step), None

    def fail_step(self, plan: BatchPlan, message: str) -> StepResult:
        return StepResult(step=plan.step, errors=[RequestError(request_id="r", message=message)])

    async def until(self, cond) -> None:
        while not cond():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), WAIT_S)


class Harness:
    def __init__(self, ex: FakeExecutor, overlap: bool = True, profiler=None):
        self.ex, self.plans, self.sent = ex, Mailbox("plans", 4), []
        self.thread = ThreadPoolExecutor(max_workers=1)
        log = logging.getLogger("test")
        self.loop = StepLoop(ex, self.thread, self.plans, self._send, overlap, log, profiler)
        self.task = asyncio.create_task(self.loop.run())

    async def _send(self, outcome: StepOutcome) -> None:
        self.sent.append(outcome.result)

    async def close(self) -> None:
        for step in self.ex.steps.values():
            step.done.set()
        await asyncio.wait_for(self.plans.join(), WAIT_S)  # every plan's outcome was sent
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
        self.loop.close()
        self.thread.shutdown(wait=True)


def plan(step: int) -> BatchPlan:
    return BatchPlan(step=step)


def test_a_queued_plan_is_launched_before_the_step_in_flight_is_read():
    asyncio.run(_a_queued_plan_is_launched_before_the_step_in_flight_is_read())


async def _a_queued_plan_is_launched_before_the_step_in_flight_is_read():
    h = Harness(FakeExecutor())
    for i in (1, 2, 3):
        h.plans.put_nowait(plan(i))
    await h.ex.until(lambda: len(h.ex.calls) == 6)
    assert h.ex.calls == [
        ("launch", 1),
        ("launch", 2),
        ("finish", 1),
        ("launch", 3),
        ("finish", 2),
        ("finish", 3),
    ]
    await h.close()
    assert [r.step for r in h.sent] == [1, 2, 3]


def test_a_ready_result_is_sent_without_waiting_for_a_plan():
    asyncio.run(_a_ready_result_is_sent_without_waiting_for_a_plan())


async def _a_ready_result_is_sent_without_waiting_for_a_plan():
    h = Harness(FakeExecutor())
    h.plans.put_nowait(plan(1))
    await h.ex.until(lambda: ("finish", 1) in h.ex.calls)
    await asyncio.wait_for(h.plans.join(), WAIT_S)  # its result went out with no second plan queued
    assert [r.step for r in h.sent] == [1]
    await h.close()


def test_a_plan_that_arrives_while_a_step_runs_is_launched_before_that_step_is_read():
    asyncio.run(_a_plan_that_arrives_while_a_step_runs_is_launched_before_that_step_is_read())


async def _a_plan_that_arrives_while_a_step_runs_is_launched_before_that_step_is_read():
    h = Harness(FakeExecutor(hold={1, 2}))
    h.plans.put_nowait(plan(1))
    await h.ex.until(lambda: h.ex.calls == [("launch", 1)])
    h.plans.put_nowait(plan(2))  # step 1 still runs: the loop waits for whichever comes first
    await h.ex.until(lambda: ("launch", 2) in h.ex.calls)
    assert h.ex.calls == [("launch", 1), ("launch", 2)] and h.sent == []
    h.ex.steps[1].done.set()
    await h.ex.until(lambda: ("finish", 1) in h.ex.calls)
    assert ("finish", 2) not in h.ex.calls  # step 2 is still running
    h.ex.steps[2].done.set()
    await h.ex.until(lambda: ("finish", 2) in h.ex.calls)
    await h.close()
    assert [r.step for r in h.sent] == [1, 2]


def test_the_serial_path_finishes_each_step_before_the_next_launch():
    asyncio.run(_the_serial_path_finishes_each_step_before_the_next_launch())


async def _the_serial_path_finishes_each_step_before_the_next_launch():
    h = Harness(FakeExecutor(), overlap=False)
    for i in (1, 2):
        h.plans.put_nowait(plan(i))
    await h.ex.until(lambda: len(h.ex.calls) == 4)
    assert h.ex.calls == [("launch", 1), ("finish", 1), ("launch", 2), ("finish", 2)]
    await h.close()


def test_a_failed_launch_is_reported_after_the_step_before_it():
    asyncio.run(_a_failed_launch_is_reported_after_the_step_before_it())


async def _a_failed_launch_is_reported_after_the_step_before_it():
    h = Harness(FakeExecutor(hold={1}, fail={2}))
    h.plans.put_nowait(plan(1))
    h.plans.put_nowait(plan(2))
    await h.ex.until(lambda: ("launch", 2) in h.ex.calls)
    h.ex.steps[1].done.set()
    await asyncio.wait_for(h.plans.join(), WAIT_S)
    assert [r.step for r in h.sent] == [1, 2]
    assert not h.sent[0].errors and "forward failed" in h.sent[1].errors[0].message
    await h.close()
