"""A handler failure injected into each stage of a real server (`lorapipe serve`, CPU, tiny model, with
`LORAPIPE_INJECT_FAULT`) fails only the requests that depended on the message, with `stage_failed`
naming the stage (and the adapter), within seconds; requests beside them complete, health reports each
stage degraded, each stage counts its handler errors, and the server keeps serving."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from runtime.base.faults import ENV
from runtime.client import AsyncClient, StageFailed
from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(240)

FAULTS = ",".join(
    [
        "tokenizer:GenerateRequest:TOKFAULT",  # the tokenizer fails on requests with this prompt text
        "scheduler:TokenizedRequest:'sfault'",  # the scheduler fails on requests for adapter sfault
        "loader:StageAdapter:'lfault'",  # the loader fails on every write of adapter lfault
        "worker:SlotLoad:'wfault'",  # the worker fails every copy of adapter wfault into its pool
    ]
)
FAULT_BOUND_S = 10.0  # a request that depended on a failed message ends within this
FLAGS = ("--max-lora-rank", "16", "--num-pages", "256", "--max-loras-per-batch", "4")


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters):
    a = next(iter(llama_adapters.values()))
    adapters = {"good": a, "sfault": a, "lfault": a, "wfault": a}
    os.environ[ENV] = FAULTS
    try:
        with serve(tiny_llama, adapters, *FLAGS) as s:
            yield s
    finally:
        del os.environ[ENV]


def test_each_stage_fault_fails_only_its_requests(server):
    async def main() -> None:
        async with AsyncClient(server.endpoint) as c:
            healthy = [
                c.generate(f"healthy {i}", adapter="good" if i % 2 else None, max_tokens=6, temperature=0)
                for i in range(12)
            ]
            faulty = {
                "tokenizer": c.generate("TOKFAULT here", adapter="good", max_tokens=4, timeout=FAULT_BOUND_S),
                "scheduler": c.generate("x", adapter="sfault", max_tokens=4, timeout=FAULT_BOUND_S),
                "adapter-loader": c.generate("x", adapter="lfault", max_tokens=4, timeout=FAULT_BOUND_S),
                "gpu-worker": c.generate("x", adapter="wfault", max_tokens=4, timeout=FAULT_BOUND_S),
            }
            t0 = time.monotonic()
            got = await asyncio.gather(*faulty.values(), return_exceptions=True)
            elapsed = time.monotonic() - t0
            for stage, result in zip(faulty, got, strict=True):
                assert isinstance(result, StageFailed), f"{stage}: {result!r}"
                assert stage in str(result), f"the error does not name the {stage}: {result}"
            assert "'lfault'" in str(got[2]) and "'wfault'" in str(got[3]), got
            assert elapsed < FAULT_BOUND_S
            done = await asyncio.gather(*healthy)
            assert all(d.finish_reason == "length" and len(d.token_ids) == 6 for d in done)
            health = await c.health()
            status = {h.stage: h.status for h in health.stages}
            for stage in ("tokenizer", "scheduler", "loader", "worker"):
                assert status[stage] == "degraded", f"{stage}: {status}"
            after = await c.generate("still serving", adapter="good", max_tokens=3, temperature=0)
            assert len(after.token_ids) == 3

    asyncio.run(main())
    m = server.metrics()
    for stage in ("tokenizer", "scheduler", "loader"):
        errors = sum(
            v for (name, st_, _), v in m.items() if name == "lorapipe_handler_errors_total" and st_ == stage
        )
        assert errors >= 1, f"{stage} counted no handler error"
