"""Heavy churn against transformers + PEFT: 24 adapters of mixed ranks (1 to 16, odd ones too), about
ten times more adapter rows than a 16-row GPU pool, in bursty phases with base-only requests beside
them. Every request's greedy tokens equal running it alone through PeftModel, with synchronous and with
overlapped, prefetched loads; the pool really churned and ended without a leaked row or reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.sampling import SamplingParams
from runtime.offline import LLM
from runtime.synthetic.adapters import make_adapters
from tests.conftest import pool_gb
from tests.peft_reference import PeftReference

pytestmark = pytest.mark.timeout(600)

RANKS = (1, 3, 4, 8, 16, 5)
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def churn_adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("churn_adapters")
    paths = []
    for i, rank in enumerate(RANKS):
        paths += make_adapters(
            tiny_llama, out / f"r{rank}", n=4, ranks=(rank,), seed=40 + i, prefix=f"c{rank}_"
        )
    return {p.name: p for p in paths}  # 24 adapters, 148 rank rows


@pytest.fixture(scope="module")
def workload(churn_adapters):
    """Six phases of eight requests: each phase hammers four adapters (and the base model)."""
    names = sorted(churn_adapters)
    work = []
    for phase in range(6):
        group = [names[(4 * phase + 5 * k) % len(names)] for k in range(4)] + [None]
        for i in range(8):
            prompt = [(11 * phase + 3 * i + j) % 200 + 1 for j in range(2 + (i * 3) % 7)]
            work.append((prompt, group[i % len(group)]))
    return work


@pytest.fixture(scope="module")
def expected(tiny_llama, churn_adapters, workload):
    ref = PeftReference(tiny_llama, churn_adapters)
    out = []
    for prompt, name in workload:
        ids = list(prompt)
        for _ in range(MAX_TOKENS):  # greedy, one request alone
            ids.append(int(ref.logits(ids, name)[-1].argmax()))
        out.append(ids[len(prompt) :])
    return out


@pytest.mark.parametrize("overlap,depth", [(False, 0), (True, 8)], ids=["sync", "overlap-prefetch"])
def test_greedy_tokens_match_peft_under_heavy_churn(
    tiny_llama, churn_adapters, workload, expected, overlap, depth
):
    llm = LLM(
        tiny_llama,
        device="cpu",
        adapters=churn_adapters,
        lora_gpu_memory_gb=pool_gb(tiny_llama, 16),
        max_lora_rank=16,
        max_loras_per_batch=3,
        max_running_requests=6,
        max_tokens_per_step=32,
        overlap_loading=overlap,
        prefetch_depth=depth,
        max_adapter_bypass=4,
        lora_backend="torch",
    )
    outs = llm.generate(
        [p for p, _ in workload],
        adapters=[a for _, a in workload],
        sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    for i, (out, want) in enumerate(zip(outs, expected, strict=True)):
        assert out.token_ids == want, f"request {i} ({workload[i][1]}): {out.token_ids} != {want}"
    pool = llm.last_planner.pool
    assert llm.last_stats.adapter_loads >= len(churn_adapters), "the pool never churned"
    assert pool.rows.num_free + sum(r.rows for r in pool.residents.values()) == pool.rows.total_rows
    assert all(r.refs == 0 for r in pool.residents.values()), "references leaked"
