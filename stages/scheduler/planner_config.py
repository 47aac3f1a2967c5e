"""The planner's settings: the policy known before the worker starts (`runtime/engine_args.py` derives
it), and the config it becomes once the worker reports its KV cache and GPU adapter pool."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class PlannerPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """The planner's settings known before the worker starts (the launcher's and the offline engine's
    one derivation: `runtime/engine_args.py`); `PlannerConfig.from_policy` adds what the worker reports.
    Each field is the engine knob (`EngineArgs`) of the same name, with the same default: a default here
    only serves a `SchedulerConfig` built without a policy (tests/runtime/test_defaults.py holds them
    equal)."""

    max_loras_per_batch: int | None = None  # None: as many as the pool has adapter ids
    max_running_requests: int = 64
    max_tokens_per_step: int = 2048
    pinned_adapters: tuple[str, ...] = ()
    overlap_loading: bool = True
    prefetch_depth: int = 8
    overlap_min_mb: float = 128.0
    max_adapter_bypass: int = 16
    adapter_affinity_steps: int = 200
    prefix_caching: bool = True


_POLICY = PlannerPolicy()  # the engine's defaults, which PlannerConfig's own follow
# policy fields PlannerConfig holds as they are (max_loras_per_batch is resolved against the pool)
_COPIED = tuple(f for f in PlannerPolicy.__struct_fields__ if f != "max_loras_per_batch")


@dataclass(frozen=True)
class PlannerConfig:
    num_pages: int
    page_size: int
    pool_rows: int  # rank rows of the worker's GPU adapter pool (an adapter of rank r takes r)
    pool_ids: int  # adapter ids of the pool (resident adapters at most)
    pool_row_bytes: int = 0  # bytes of one rank row over all layers (for the pool's byte gauges)
    max_lora_rank: int = 64  # the largest adapter rank: pinned adapters always leave room for one
    max_loras_per_batch: int = 8  # distinct adapters in one step (every running request's counts)
    max_running_requests: int = _POLICY.max_running_requests
    max_tokens_per_step: int = _POLICY.max_tokens_per_step
    max_model_len: int = 4096
    pinned_adapters: tuple[str, ...] = ()
    # The policy's knobs follow, under the engine's names and with its defaults (`_POLICY`: the engine
    # sets every one from its policy in `from_policy`; a unit test that wants the planner alone turns
    # them off itself).
    # A load marks its slot loading (never a victim) until the worker reports it ready; requests that
    # need it are admitted at once (the worker gates each layer on its copy). Off: the synchronous
    # baseline, where the step that carries a load waits for all of it.
    overlap_loading: bool = _POLICY.overlap_loading
    prefetch_depth: int = _POLICY.prefetch_depth  # waiting requests looked ahead at for slot loads
    # Adapters smaller than this are neither marked loading nor prefetched into slots: evicting for a
    # load that cheap only churns slots (measured: 32 adapters of 11 MB in 8 slots ran 17% slower).
    overlap_min_mb: float = _POLICY.overlap_min_mb
    # Steps in which later requests may be admitted before one whose adapter is staged; then it is due
    # and the planner reserves what it needs (stages/scheduler/admission.py). Bounds every adapter wait.
    max_adapter_bypass: int = _POLICY.max_adapter_bypass
    # Adapter affinity: waiting requests whose adapter is already in the step are admitted before the
    # others, each request at most this many steps after it was queued (then it goes back to queue
    # order). Fewer distinct adapters per running request; 0: plain queue order.
    adapter_affinity_steps: int = _POLICY.adapter_affinity_steps
    # Reuse the KV of full prompt pages cached by earlier requests of the same adapter (and generation)
    # and the same tokens (stages/scheduler/page_allocator.py); off: every prompt is computed whole.
    prefix_caching: bool = _POLICY.prefix_caching

    @property
    def overlap_min_bytes(self) -> int:
        return int(self.overlap_min_mb * 2**20)

    @classmethod
    def from_policy(
        cls,
        policy: PlannerPolicy,
        *,
        num_pages: int,
        page_size: int,
        pool_rows: int,
        pool_ids: int,
        pool_row_bytes: int,
        max_lora_rank: int,
        max_model_len: int,
    ) -> PlannerConfig:
        """The config for a worker's KV cache and adapter pool (what `WorkerStarted` reports)."""
        return cls(
            num_pages=num_pages,
            page_size=page_size,
            pool_rows=pool_rows,
            pool_ids=pool_ids,
            pool_row_bytes=pool_row_bytes,
            max_lora_rank=max_lora_rank,
            max_loras_per_batch=policy.max_loras_per_batch or pool_ids,
            max_model_len=max_model_len,
            **{name: getattr(policy, name) for name in _COPIED},
        )

    def __post_init__(self):
        if self.max_model_len > self.num_pages * self.page_size:
            # One request must always fit alone, or preemption could cycle forever.
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV cache's "
                f"{self.num_pages * self.page_size} tokens; lower max_model_len or give the cache more pages"
            )
        if self.pool_rows < self.max_lora_rank:
            raise ValueError(
                f"the adapter pool's {self.pool_rows} rank rows do not hold an adapter of rank "
                f"{self.max_lora_rank}"
            )
        if self.max_tokens_per_step < self.max_running_requests:
            raise ValueError(
                "max_tokens_per_step must be >= max_running_requests (every running request "
                "gets at least one token per step)"
            )
