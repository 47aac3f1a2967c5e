"""Scheduler ⇄ gpu-worker messages (PUSH/PULL each way). A BatchPlan carries data sent once per request
(`NewRequestData`) plus small per-step diffs (`CachedRequestData`), vLLM v1 style, so its size follows
what changed rather than the batch size."""

from __future__ import annotations

import msgspec

from proto.base import Message, Record, TokenIds, edge
from proto.client import FinishReason
from proto.sampling import SamplingParams


class NewRequestData(Record):
    """A request the worker has not seen (or one resumed after preemption): sent once."""

    request_id: str
    prompt_ids: TokenIds
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    slot: int = -1  # adapter id of its adapter in the GPU pool; -1 = base model only
    page_ids: list[int] = []  # KV pages allocated so far, in sequence order
    num_computed_tokens: int = 0  # tokens whose KV is already in those pages (prefix cache / resume)
    num_scheduled_tokens: int = 0  # prompt tokens to run this step (< the rest = chunked prefill)
    output_ids: list[int] = []  # tokens already generated (a resumed request)


class CachedRequestData(Record):
    """A request the worker already holds, scheduled again this step (a decode, a further prefill
    chunk, or a resume after preemption)."""

    request_id: str
    new_page_ids: list[int] = []  # appended to its page list
    num_scheduled_tokens: int = 1  # >1 while its prefill is still being chunked
    resumed: bool = False  # back after preemption: new_page_ids replace all its pages (KV recomputed)
    slot: int = -1  # its adapter id when resumed (the adapter may have another id by now)
    num_computed_tokens: int = 0  # when resumed: tokens whose KV its new pages already hold (cached)


class SlotLoad(Record):
    """Copy a staged adapter from the host cache (shared memory written by the loader) into the GPU
    adapter pool on the worker's load stream, as adapter id `slot`: its rank row k of every layer goes to
    pool row `row_starts[j] + (k - sum(row_counts[:j]))` of the run j that covers k. The scheduler chose
    the id and the rows (no other resident adapter holds them). The worker reports `slot` in
    `slots_ready` once the copy's event fired."""

    slot: int  # the adapter id: the row of the worker's rank/scaling/row tables
    adapter: str
    shm_name: str = ""  # shared_memory name of the host-cache pool ("": an in-process host cache)
    offset: int = 0  # byte offset of the packed block inside that pool
    nbytes: int = 0  # bytes of the block: num_layers * layer_nbytes
    rank: int = 0  # the block is [num_layers, rank, row_elems]
    layer_nbytes: int = 0  # bytes of one layer: rank * row_elems * itemsize
    dtype: str = "bfloat16"
    slice_ranks: list[int] = []  # flat [num_layers * NUM_SLICES], layer-major; 0 = module not adapted
    slice_scalings: list[float] = []  # flat [num_layers * NUM_SLICES]
    # copy layer by layer with one event per layer, so a step may run layer i before later layers are in
    # (overlapped loads of large adapters); otherwise one copy, which small blocks need for full bandwidth
    layered: bool = False
    row_starts: list[int] = []  # runs of pool rows holding rank rows 0..rank-1, in rank order
    row_counts: list[int] = []  # rows of each run; they sum to `rank`


class BatchPlan(Message):
    """One step. The worker's running set persists across plans: running = running + new_requests
    - finished_request_ids - preempted_request_ids; loads/clears apply before the step's forward."""

    step: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    finished_request_ids: list[str] = []  # finished or aborted: free the worker's state for them
    preempted_request_ids: list[str] = []  # drop their KV and pages, keep their tokens; they come back
    # as CachedRequestData(resumed=True)
    slot_loads: list[SlotLoad] = []
    slot_clears: list[int] = []


class FinishedRequest(Record):
    request_id: str
    reason: FinishReason
    num_output_tokens: int


class RequestError(Record):
    request_id: str
    message: str


class SlotError(Record):
    slot: int
    adapter: str
    message: str


class StepResult(Message):
    """Outcome of step `step`. Every request the step ran that is not in `finished` or `errors`
    produced exactly what the plan asked (one token per decode, one at the end of a full prefill)."""

    step: int
    finished: list[FinishedRequest] = []
    errors: list[RequestError] = []
    slots_ready: list[int] = []  # loads whose copy completed (their slot may be used from now on)
    slot_errors: list[SlotError] = []
    num_tokens: int = 0  # tokens processed this step (prefill + decode)
    step_time: float = 0.0  # seconds of forward + sampling


class SlotsReady(Message):
    """Slot loads that completed while the worker had no step to report them with."""

    slots_ready: list[int] = []
    slot_errors: list[SlotError] = []


class WorkerStarted(Message):
    """The worker's first message to the scheduler: what its KV cache and its GPU adapter pool turned
    out to hold (sized from free device memory), so the scheduler can start planning."""

    num_pages: int
    page_size: int
    max_model_len: int
    lora_rows: int = 0  # rank rows of the adapter pool (an adapter of rank r takes r of them)
    lora_ids: int = 0  # adapter ids (resident adapters at most)
    lora_row_bytes: int = 0  # bytes of one rank row over all layers (capacity = lora_rows * this)
    lora_max_rank: int = 0  # the largest adapter rank the pool takes (--max-lora-rank)


class WarmupProgress(Message):
    """While the worker compiles and loads its kernels (before WorkerStarted): steps done of the total
    (the compile pool's kernels, then the variant launches that load them), for health probes."""

    done: int
    total: int


SchedulerToWorker = edge("scheduler_to_worker", BatchPlan)
WorkerToScheduler = edge("worker_to_scheduler", WorkerStarted, StepResult, SlotsReady, WarmupProgress)
