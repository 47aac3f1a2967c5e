"""On a GPU: requests on a resident slot keep decoding while another slot's copy is in flight. The copy
goes through the worker's own `_load_slot` (the shared-memory host pool registered as pinned, the load
stream, one event), queued behind a large pinned ballast copy on that stream so it stays in flight for
a few hundred ms. With overlapped loading, steps must finish their compute and sample tokens while the
load's event is still pending, and the resident requests' tokens must equal a run with no load; the slot
then holds the adapter and decodes like one loaded synchronously. With synchronous loading the same
probe sees the load complete within its step: the control showing the probe can fail. Skipped without
CUDA (run on the GPU machine)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from proto.base import TokenIds
from proto.loader import AdapterStaged
from proto.plan import BatchPlan, NewRequestData, SlotLoad
from proto.sampling import SamplingParams
from runtime.common.host_pool import (
    block_tensor,
    create_pool,
    dtype_name,
    pool_bytes_for,
    register_pinned,
    slot_load_for,
    unlink_pool,
    unregister_pinned,
)
from runtime.common.packed import PackedAdapter
from stages.loader.adapter_reader import read_adapter
from stages.worker.actor import WorkerActor
from stages.worker.executor import StepExecutor
from stages.worker.runner import ModelRunner, RunnerConfig
from stages.worker.slot_loads import LoadHandle

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]

RESIDENT, LOADED = "full8", "rs12"  # llama_adapters names: slot 0 resident, slot 1 loaded during decode
PROMPTS = ([5, 17, 42, 99, 3, 8, 250, 11], [7, 7, 120, 33, 64])
MAX_TOKENS = 40
LOAD_AT_STEP = 3  # after the prefill and a first decode (kernels compiled, graphs warm)
BALLAST_BYTES = 256 << 20
BALLAST_MS = 300.0  # how long the load stream stays busy before the slot copy itself
MIN_STEPS_DURING_LOAD = 3


class _Counter:
    def labels(self, **_: str) -> _Counter:
        return self

    def inc(self, *_: float) -> None: ...


class SlowLoads:
    """The state `WorkerActor._load_slot` reads (pool, runner, load stream), with a ballast of pinned
    copies queued on the load stream before each slot copy, so the copy's event completes late."""

    def __init__(self, runner: ModelRunner, pool):
        self.runner, self.host_pool, self.cuda = runner, pool, True
        self.load_stream = torch.cuda.Stream(runner.device)
        self.m_loads = _Counter()
        self.handles: list[LoadHandle] = []
        self.src = torch.empty(BALLAST_BYTES, dtype=torch.uint8, pin_memory=True).fill_(3)
        self.dst = torch.empty(BALLAST_BYTES, dtype=torch.uint8, device=runner.device)
        self.reps = min(64, math.ceil(BALLAST_MS / self._copy_ms()))

    def _copy_ms(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._ballast(1)
        start.record(self.load_stream)
        self._ballast(1)
        end.record(self.load_stream)
        end.synchronize()
        return start.elapsed_time(end)

    def _ballast(self, reps: int) -> None:
        with torch.cuda.stream(self.load_stream):
            for _ in range(reps):
                self.dst.copy_(self.src, non_blocking=True)

    def __call__(self, load: SlotLoad) -> LoadHandle:
        self._ballast(self.reps)
        handle = WorkerActor._load_slot(self, load)  # the worker's own copy path, on our stand-in
        self.handles.append(handle)
        return handle


@dataclass
class Trace:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    steps_during_load: int = 0  # steps whose compute finished, with tokens, while the load was pending
    slots_ready: list[int] = field(default_factory=list)


def _runner(model, graphs: bool) -> ModelRunner:
    kw = {}
    if graphs:
        if "cuda_graph_max_batch" not in {f.name for f in dataclasses.fields(RunnerConfig)}:
            pytest.skip("this runner has no decode CUDA graphs")
        kw["cuda_graph_max_batch"] = 4
    cfg = RunnerConfig(
        model_dir=str(model),
        device="cuda",
        dtype="bfloat16",
        max_lora_rank=16,
        lora_backend="triton",
        num_pages=64,
        layered_min_bytes=1,  # as a server with overlapped loading: any adapter may be copied by layer
        **kw,
    )
    return ModelRunner(cfg)


def _staged(packed: PackedAdapter, pool, runner: ModelRunner) -> SlotLoad:
    """What the loader announces after packing `packed` at offset 0 of the pool, as the scheduler sends it."""
    block_tensor(pool, 0, packed.rank, runner.lora_layout, runner.dtype).copy_(packed.block)
    staged = AdapterStaged(
        name=packed.name,
        shm_name=pool.name,
        offset=0,
        nbytes=packed.nbytes,
        rank=packed.rank,
        layer_nbytes=packed.rank * runner.lora_layout.row_elems * packed.block.element_size(),
        dtype=dtype_name(runner.dtype),
        slice_ranks=packed.ranks.flatten().tolist(),
        slice_scalings=packed.scalings.flatten().tolist(),
    )
    return slot_load_for(staged, 1, [(16, packed.rank)])  # id 1 at pool rows 16..


def _decode(runner, loads, slot: int, prompts, overlap: bool, load: SlotLoad | None = None) -> Trace:
    """Greedy decode of `prompts` on `slot` to MAX_TOKENS; `load` goes out in the plan of LOAD_AT_STEP.
    After each step the compute stream is synchronized and the load's event is queried."""
    ex = StepExecutor(runner, loads, max_model_len=256, overlap_loading=overlap)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    new = [
        NewRequestData(
            request_id=f"r{i}",
            prompt_ids=TokenIds.of(list(p)),
            sampling=sampling,
            slot=slot,
            page_ids=list(range(4 * i, 4 * i + 4)),
            num_scheduled_tokens=len(p),
        )
        for i, p in enumerate(prompts)
    ]
    trace = Trace(tokens={r.request_id: [] for r in new})
    finished: set[str] = set()
    step, plan = 1, BatchPlan(step=1, new_requests=new)
    while len(finished) < len(new):
        result, batch = ex.execute(plan)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(runner.device))
        done.synchronize()  # this step's forward and sampling are over
        pending = load is not None and step >= LOAD_AT_STEP and not loads.handles[-1].event.query()
        trace.steps_during_load += pending and bool(batch.items)
        trace.slots_ready += result.slots_ready
        for item in batch.items:
            trace.tokens[item.request_id] += item.token_ids
            if item.finish_reason:
                finished.add(item.request_id)
        step += 1
        plan = BatchPlan(step=step, slot_loads=[load] if load is not None and step == LOAD_AT_STEP else [])
    torch.cuda.synchronize()
    trace.slots_ready += ex.poll_loads()
    return trace


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "graphs"])
def setup(request, tiny_llama, llama_adapters):
    runner = _runner(tiny_llama, graphs=request.param)
    read = {
        name: read_adapter(
            name, llama_adapters[name], runner.model_cfg, runner.lora_layout, runner.dtype, pin_memory=True
        )
        for name in (RESIDENT, LOADED)
    }
    runner.load_adapter(0, read[RESIDENT], [(0, read[RESIDENT].rank)])
    runner.load_adapter(1, read[LOADED], [(16, read[LOADED].rank)])  # synchronously, for the reference runs
    torch.cuda.synchronize()
    pool = create_pool("lorapipe-gputest-", pool_bytes_for(runner.lora_layout, 16, runner.dtype, 1))
    register_pinned(pool)
    loads = SlowLoads(runner, pool)
    reference = _decode(runner, loads, 0, PROMPTS, overlap=True)
    on_loaded_slot = _decode(runner, loads, 1, PROMPTS[:1], overlap=True)
    try:
        yield runner, loads, read[LOADED], _staged(read[LOADED], pool, runner), reference, on_loaded_slot
    finally:
        torch.cuda.synchronize()
        unregister_pinned(pool)
        unlink_pool(pool)


def _empty_slot(runner: ModelRunner) -> None:
    runner.pool.clear(1)
    runner.pool.mem[:, 16:32].zero_()
    torch.cuda.synchronize()


@pytest.mark.parametrize("layered", [False, True], ids=["single-copy", "layered"])
def test_resident_requests_decode_while_a_slot_load_is_in_flight(setup, layered):
    runner, loads, packed, load, reference, on_loaded_slot = setup
    load = msgspec.structs.replace(load, layered=layered)
    _empty_slot(runner)
    got = _decode(runner, loads, 0, PROMPTS, overlap=True, load=load)
    assert got.steps_during_load >= MIN_STEPS_DURING_LOAD, (
        f"only {got.steps_during_load} steps finished while the load was in flight: "
        "the compute stream waited for a copy no step needed"
    )
    assert got.tokens == reference.tokens, "resident requests decoded differently beside the load"
    assert got.slots_ready == [1] and loads.handles[-1].event.query() and not loads.handles[-1].waited
    rank = packed.rank
    assert torch.equal(runner.pool.mem[:, 16 : 16 + rank].cpu(), packed.block)
    assert torch.equal(runner.pool.ranks[1].cpu(), packed.ranks) and runner.pool.names[1] == packed.name
    after = _decode(runner, loads, 1, PROMPTS[:1], overlap=True)
    assert after.tokens == on_loaded_slot.tokens, "the overlapped copy decodes unlike a synchronous load"


def test_synchronous_load_holds_its_step_back(setup):
    """The control: when the step waits for the copy, no step finishes while it is pending."""
    runner, loads, packed, load, reference, _ = setup
    _empty_slot(runner)
    got = _decode(runner, loads, 0, PROMPTS, overlap=False, load=load)
    assert got.steps_during_load == 0 and loads.handles[-1].waited
    assert got.tokens == reference.tokens and got.slots_ready == [1]
    assert torch.equal(runner.pool.mem[:, 16 : 16 + packed.rank].cpu(), packed.block)
