"""The pipeline with overlapped loading and prefetch on and off (`lorapipe serve` as a subprocess, CPU,
tiny model): greedy outputs equal the offline engine's on a bursty workload with about three times more
adapter rows than the GPU pool holds, and the residency, pool, copy, adapter-wait and queue-wait metrics
are exported."""

from __future__ import annotations

import asyncio

import pytest

from runtime.client import AsyncClient
from tests.conftest import pool_gb
from tests.integration.serving import serve
from tests.runtime.test_overlap_loading import MAX_TOKENS, POOL_ROWS, bursty_workload, many_adapters, run

pytestmark = pytest.mark.timeout(300)
__all__ = ["many_adapters"]  # the module fixture, shared with the offline test

BASE_FLAGS = ("--max-loras-per-batch", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16")
BASE_FLAGS += ("--num-pages", "256", "--max-running-requests", "6", "--max-tokens-per-step", "48")


@pytest.fixture(scope="module")
def reference(tiny_llama, many_adapters):
    tokens, _ = run(tiny_llama, many_adapters, overlap=False, depth=0)
    return tokens


@pytest.mark.parametrize(
    "flags",
    [
        ("--overlap-loading", "--prefetch-depth", "8", "--overlap-min-mb", "0"),  # every load overlapped
        ("--overlap-loading", "--prefetch-depth", "8"),  # tiny adapters: under the threshold, synchronous
        ("--no-overlap-loading", "--prefetch-depth", "0"),
        ("--max-plans-in-flight", "1"),  # the scheduler waits for each step's result
        ("--max-plans-in-flight", "5"),  # plans queued at the worker beyond the two it runs
    ],
    ids=["overlap-all", "overlap-large-only", "sync", "plans-1", "plans-5"],
)
def test_pipeline_outputs_equal_the_offline_engine(tiny_llama, many_adapters, reference, flags):
    work = bursty_workload(sorted(many_adapters))
    pool = ("--lora-gpu-memory-gb", repr(pool_gb(tiny_llama, POOL_ROWS)))
    with serve(tiny_llama, many_adapters, *BASE_FLAGS, *pool, *flags) as server:

        async def main():
            async with AsyncClient(server.endpoint, timeout=120) as c:
                # phases arrive one after another, each as a burst of concurrent requests
                outs = []
                for start in range(0, len(work), 8):
                    outs += await asyncio.gather(
                        *(
                            c.generate(p, a, max_tokens=MAX_TOKENS, ignore_eos=True)
                            for p, a in work[start : start + 8]
                        )
                    )
                return outs

        outs = asyncio.run(main())
        for i, (out, want) in enumerate(zip(outs, reference, strict=True)):
            assert out.token_ids == want, f"request {i} (adapter {work[i][1]})"
        assert server.metric("lorapipe_slot_copy_bytes_total", "worker") > 0
        assert server.metric("lorapipe_adapter_wait_seconds_count", "scheduler") > 0
        tiers = server.metric("lorapipe_adapters_by_tier", "scheduler")
        assert tiers == len(many_adapters)
        assert server.metric("lorapipe_lora_pool_rows_capacity", "scheduler") == POOL_ROWS
        assert server.metric("lorapipe_lora_pool_rows_used", "scheduler") <= POOL_ROWS
        assert server.metric("lorapipe_adapter_wait_quantile_seconds", "scheduler") > 0
        # every request admitted once (a preempted one is not counted again); a request that waited for its
        # adapter waited at least that long in the queue
        assert server.metric("lorapipe_request_queue_seconds_count", "scheduler") == len(work)
        queued = server.metric("lorapipe_request_queue_seconds_sum", "scheduler")
        assert queued >= server.metric("lorapipe_adapter_wait_seconds_sum", "scheduler") > 0
