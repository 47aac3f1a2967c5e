"""Slot copies in flight on the worker, with stand-in events: a step that does not use a loading slot
never waits on its copy, a step that uses it waits exactly once, and the slot is reported ready only
after its event completed (polled, never blocking); through the executor with a tiny model too."""

from __future__ import annotations

import pytest
import torch

from proto.base import TokenIds
from proto.plan import BatchPlan, NewRequestData, SlotLoad
from proto.sampling import SamplingParams
from stages.worker.executor import StepExecutor
from stages.worker.runner import ModelRunner, RunnerConfig, whole_copy_waits
from stages.worker.slot_loads import LoadHandle, PendingLoads

pytestmark = pytest.mark.timeout(60)


class FakeEvent:
    def __init__(self):
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True

    def elapsed_time(self, end) -> float:
        return 2.0  # ms


class FakeStream:
    def __init__(self):
        self.waited: list[FakeEvent] = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


@pytest.fixture
def stream(monkeypatch) -> FakeStream:
    s = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: s)
    return s


def test_waits_only_for_used_slots_and_reports_after_completion(stream):
    done: list[LoadHandle] = []
    pending = PendingLoads(done.append)
    event = FakeEvent()
    pending.add(LoadHandle(slot=1, nbytes=100, event=event, start_event=FakeEvent()))
    pending.wait_for({0}, torch.device("cpu"))
    assert stream.waited == [] and pending.poll() == [] and pending
    event.complete = True
    assert pending.poll() == [1] and not pending
    assert done[0].seconds() == pytest.approx(2e-3) and not done[0].waited
    pending.add(LoadHandle(slot=2, nbytes=100, event=(e2 := FakeEvent())))
    pending.wait_for({2}, torch.device("cpu"))
    pending.wait_for({2}, torch.device("cpu"))
    assert stream.waited == [e2] and pending.by_slot[2].waited


def _executor(tiny_llama, llama_adapters, overlap: bool) -> tuple[StepExecutor, list[FakeEvent]]:
    from stages.loader.adapter_reader import read_adapter

    runner = ModelRunner(RunnerConfig(model_dir=str(tiny_llama), max_lora_rank=16))
    packed = read_adapter(
        "qv5", llama_adapters["qv5"], runner.model_cfg, runner.lora_layout, runner.dtype, pin_memory=False
    )
    events: list[FakeEvent] = []

    def load(sl: SlotLoad) -> LoadHandle:
        runner.load_adapter(sl.slot, packed, [(sl.slot * 16, packed.rank)])
        events.append(FakeEvent())
        return LoadHandle(sl.slot, 1, event=events[-1])

    return StepExecutor(runner, load, max_model_len=256, overlap_loading=overlap), events


def test_synchronous_loading_makes_the_step_wait(tiny_llama, llama_adapters, stream):
    ex, events = _executor(tiny_llama, llama_adapters, overlap=False)
    req = NewRequestData(
        request_id="a", prompt_ids=TokenIds.of([4, 5]), slot=0, page_ids=[0], num_scheduled_tokens=2
    )
    res, _ = ex.execute(BatchPlan(step=1, new_requests=[req], slot_loads=[SlotLoad(slot=0, adapter="qv5")]))
    assert stream.waited == events and res.slots_ready == [0] and not ex.pending


def test_executor_runs_resident_requests_while_a_load_is_pending(tiny_llama, llama_adapters, stream):
    ex, events = _executor(tiny_llama, llama_adapters, overlap=True)
    base = NewRequestData(
        request_id="b",
        prompt_ids=TokenIds.of([1, 2, 3]),
        sampling=SamplingParams(max_tokens=8, ignore_eos=True),
        page_ids=[0],
        num_scheduled_tokens=3,
    )
    res, tokens = ex.execute(
        BatchPlan(step=1, new_requests=[base], slot_loads=[SlotLoad(slot=0, adapter="qv5")])
    )
    assert len(tokens.items) == 1 and res.slots_ready == [] and stream.waited == []
    res, tokens = ex.execute(BatchPlan(step=2))  # the copy is still in flight: the decode goes on
    assert len(tokens.items) == 1 and res.slots_ready == [] and stream.waited == []
    events[0].complete = True
    res, _ = ex.execute(BatchPlan(step=3))
    assert res.slots_ready == [0]
    lora = NewRequestData(
        request_id="a",
        prompt_ids=TokenIds.of([4, 5]),
        sampling=SamplingParams(max_tokens=8, ignore_eos=True),
        slot=0,
        page_ids=[1],
        num_scheduled_tokens=2,
    )
    res, tokens = ex.execute(BatchPlan(step=4, new_requests=[lora]))
    assert {i.request_id for i in tokens.items} == {"a", "b"} and stream.waited == []
    assert ex.poll_loads() == []


def test_a_step_using_a_copying_slot_waits_layer_by_layer(tiny_llama, llama_adapters, stream):
    """Overlapped load with per-layer events, its request admitted in the same plan: layer i waits for
    layer i's event only (in layer order), never for the whole copy; a load no step uses is never
    waited on; synchronous loading waits for the whole copy before the step."""
    ex, _ = _executor(tiny_llama, llama_adapters, overlap=True)
    num_layers = ex.runner.model_cfg.num_layers
    handles: list[LoadHandle] = []

    def load(sl: SlotLoad) -> LoadHandle:
        layers = [FakeEvent() for _ in range(num_layers)]
        handles.append(LoadHandle(sl.slot, 1, event=FakeEvent(), layer_events=layers))
        return handles[-1]

    ex._load_adapter = load
    req = NewRequestData(
        request_id="a", prompt_ids=TokenIds.of([4, 5]), slot=0, page_ids=[0], num_scheduled_tokens=2
    )
    plan = BatchPlan(step=1, new_requests=[req], slot_loads=[SlotLoad(slot=0, adapter="qv5")])
    res, tokens = ex.execute(plan)
    assert stream.waited == handles[0].layer_events and res.slots_ready == [] and len(tokens.items) == 1
    stream.waited.clear()
    res, _ = ex.execute(BatchPlan(step=2, slot_loads=[SlotLoad(slot=1, adapter="mlp1")]))  # slot 1 unused
    assert stream.waited == [] and res.slots_ready == []
    for h in handles:
        h.event.complete = True
    assert sorted(ex.poll_loads()) == [0, 1]

    sync, _ = _executor(tiny_llama, llama_adapters, overlap=False)
    sync._load_adapter = load
    res, _ = sync.execute(plan)
    assert stream.waited == [handles[2].event] and res.slots_ready == [0] and not sync.pending


def test_layer_waits_skip_done_and_waited_copies():
    pending = PendingLoads()
    layered = LoadHandle(0, 1, event=FakeEvent(), layer_events=[FakeEvent(), FakeEvent()])
    whole = LoadHandle(1, 1, event=FakeEvent())
    done = LoadHandle(2, 1)  # a copy that completed synchronously
    finished = LoadHandle(3, 1, event=FakeEvent(), layer_events=[FakeEvent(), FakeEvent()])
    finished.event.complete = True  # a prefetch whose copy has ended since
    for h in (layered, whole, done, finished):
        pending.add(h)
    waits = pending.layer_waits({0, 1, 2, 3, 7}, num_layers=2)
    assert waits == [[layered.layer_events[0], whole.event], [layered.layer_events[1]]]
    assert not finished.waited  # it overlapped entirely: not counted as a wait
    assert pending.layer_waits({0, 1}, num_layers=2) is None  # each copy is waited on once


def test_only_whole_copy_waits_let_a_step_replay_a_graph():
    """Copies without per-layer events are waited on before the step (which may then replay a graph);
    a step with any per-layer wait runs eagerly, and one with no wait at all is left as it is."""
    whole, layered = FakeEvent(), [FakeEvent(), FakeEvent()]
    assert whole_copy_waits([[whole], []]) == [whole]
    assert whole_copy_waits([[whole, layered[0]], [layered[1]]]) is None
    assert whole_copy_waits([[], []]) is None and whole_copy_waits(None) is None
