"""Offline engine: greedy outputs are identical with overlapped loading on and off and prefetch on and
off, on a bursty workload with about four times more adapter rows than the GPU pool holds; the loads
really overlapped (requests waited for their adapter while others ran) and pinned adapters were never
evicted."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.sampling import SamplingParams
from runtime.offline import LLM
from runtime.synthetic.adapters import make_adapters
from tests.conftest import pool_gb

pytestmark = pytest.mark.timeout(300)

POOL_ROWS = 20  # room for a pin (the rest holds a rank-16 adapter); 48 rows in all
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def many_adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """Eight adapters, ranks 4 and 8 (48 rows, three times the pool)."""
    out = tmp_path_factory.mktemp("many_adapters")
    paths = make_adapters(tiny_llama, out / "r4", n=4, ranks=(4,), seed=11, prefix="a4_")
    paths += make_adapters(tiny_llama, out / "r8", n=4, ranks=(8,), seed=12, prefix="a8_")
    return {p.name: p for p in paths}


def bursty_workload(names: list[str]) -> list[tuple[list[int], str | None]]:
    """Four phases, each hammering three adapters (and the base model) before moving on."""
    work = []
    for phase in range(4):
        group = [names[(2 * phase + k) % len(names)] for k in range(3)] + [None]
        for i in range(8):
            prompt = [(7 * phase + 3 * i + j) % 200 + 1 for j in range(3 + (i * 5) % 11)]
            work.append((prompt, group[i % len(group)]))
    return work


def run(tiny_llama, adapters, overlap: bool, depth: int, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        tiny_llama,
        device="cpu",
        adapters=adapters,
        lora_gpu_memory_gb=pool_gb(tiny_llama, POOL_ROWS),
        max_loras_per_batch=2,
        max_lora_rank=16,
        max_running_requests=6,
        max_tokens_per_step=48,
        overlap_loading=overlap,
        prefetch_depth=depth,
        **kw,
    )
    work = bursty_workload(sorted(adapters))
    outs = llm.generate(
        [p for p, _ in work],
        adapters=[a for _, a in work],
        sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference(tiny_llama, many_adapters):
    tokens, llm = run(tiny_llama, many_adapters, overlap=False, depth=0)
    assert llm.last_stats.adapter_loads > 2 * len(many_adapters) // 2, "the workload never swapped"
    return tokens


@pytest.mark.parametrize("overlap,depth", [(True, 0), (False, 8), (True, 8), (True, 2)])
def test_greedy_outputs_identical_with_and_without_overlap_and_prefetch(
    tiny_llama, many_adapters, reference, overlap, depth
):
    tokens, llm = run(tiny_llama, many_adapters, overlap, depth)
    assert tokens == reference
    assert llm.last_stats.adapter_loads >= len(many_adapters)


def test_pinned_adapter_stays_resident_and_outputs_match(tiny_llama, many_adapters, reference):
    pinned = sorted(many_adapters)[0]
    tokens, llm = run(tiny_llama, many_adapters, True, 8, pinned_adapters=(pinned,))
    assert tokens == reference
    res = llm.last_planner.pool.get(pinned)
    assert res is not None and res.pinned, "the pinned adapter left the pool"
    assert llm.runner.pool.names[res.lora_id] == pinned
