"""The offline engine against transformers + PEFT: a batch mixing adapters of different ranks, target
sets and scalings with base-only requests must give, at prefill and at every decode step, the logits
of running each request alone through PeftModel, and the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from proto.sampling import SamplingParams
from runtime.offline import LLM
from tests.conftest import pool_gb
from tests.peft_reference import PeftReference
from tests.stages.worker.graph_tolerances import TOL as GRAPH_TOL

PROMPTS = [
    "The river carried the boat past the old mill",
    "A quiet morning in the village",
    "Numbers: one two three four five six seven eight nine ten eleven",
    "héllo wörld, 日本",
    "Stories begin",
    "The",
    "The engine hummed while the train crossed the long bridge over the valley at dawn",
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def check_against_peft(
    model_dir, adapters, recorded, *, max_loras_per_batch=None, lora_backend="torch", **llm_kw
):
    names = list(adapters)
    mix = [names[i % len(names)] if i % 3 != 2 else None for i in range(len(PROMPTS))]
    tol = 1e-4
    if lora_backend == "triton" and torch.cuda.is_available():
        # The interpreter runs the kernels on CPU tensors only where there is no CUDA (tests/conftest.py);
        # on a GPU machine the Triton engine runs there, graphs included, and its float32 dots are TF32.
        llm_kw.setdefault("device", "cuda")
        # Sized here: the defaults size the cache and the pool from free memory, which the engine of an
        # earlier test may still hold until it is collected.
        llm_kw.setdefault("num_pages", 512)
        llm_kw.setdefault("lora_gpu_memory_gb", pool_gb(model_dir, 16 * len(adapters)))
        tol = GRAPH_TOL
    llm = LLM(
        model_dir,
        device="cpu",
        adapters=adapters,
        max_loras_per_batch=max_loras_per_batch,
        max_lora_rank=16,
        lora_backend=lora_backend,
        **llm_kw,
    )
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS, adapters=mix, sampling=sampling)
    ref = PeftReference(model_dir, adapters)
    request_logits = [recorded[rid] for rid in sorted(recorded, key=lambda rid: int(rid[1:]))]  # r0, r1, ...
    assert len(request_logits) == len(PROMPTS)
    worst = 0.0
    for out, name, steps in zip(outs, mix, request_logits, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == 6
        full = out.prompt_token_ids + out.token_ids[:-1]
        expected = ref.logits(full, name)[len(out.prompt_token_ids) - 1 :]  # [6, V]
        assert len(steps) == 6
        for step, (got, want) in enumerate(zip(steps, expected, strict=True)):
            err = _rel(got, want)
            worst = max(worst, err)
            assert err < tol, f"adapter {name} step {step}: relative error {err:.2e}"
        assert out.token_ids == expected.argmax(-1).tolist(), f"greedy tokens differ for adapter {name}"
    return llm.last_stats


BACKENDS = pytest.mark.parametrize("backend", ["torch", "triton"])


@BACKENDS
def test_mixed_adapters_match_peft_llama(tiny_llama, llama_adapters, recorded_logits, backend):
    check_against_peft(
        tiny_llama, llama_adapters, recorded_logits, max_loras_per_batch=4, lora_backend=backend
    )


@BACKENDS
def test_mixed_adapters_match_peft_qwen2_tied(tiny_qwen2, qwen2_adapters, recorded_logits, backend):
    check_against_peft(
        tiny_qwen2, qwen2_adapters, recorded_logits, max_loras_per_batch=4, lora_backend=backend
    )


@BACKENDS
@pytest.mark.parametrize("affinity", [0, 200], ids=["queue-order", "affinity"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync-load", "overlap-prefetch"])
def test_more_adapters_than_the_pool_swaps_and_matches(
    tiny_llama, llama_adapters, recorded_logits, backend, overlap, affinity
):
    # A 16-row pool for four adapters of ranks 8, 5, 1 and 12 (26 rows), at most two adapters per step,
    # small pages and a tight token budget: swaps, chunked prefill, preemption. In queue order the
    # requests alternate adapters and force swaps; adapter affinity groups them, so fewer are needed.
    stats = check_against_peft(
        tiny_llama,
        llama_adapters,
        recorded_logits,
        max_loras_per_batch=2,
        lora_gpu_memory_gb=pool_gb(tiny_llama, 16),
        page_size=4,
        num_pages=24,
        max_tokens_per_step=16,
        max_running_requests=4,
        lora_backend=backend,
        overlap_loading=overlap,
        prefetch_depth=8 if overlap else 0,
        adapter_affinity_steps=affinity,
        # the swap and preemption counts below are the point: a preempted request resumed from its
        # cached prefix would need fewer steps and swaps (tests/runtime/test_prefix_caching_vs_peft.py
        # checks cached prefixes under KV pressure)
        prefix_caching=False,
    )
    # each of the four adapters is loaded at least once; in queue order synchronous loading swaps more
    assert stats.adapter_loads > (4 if not overlap and not affinity else 2), "adapters were never swapped"
    assert stats.preemptions > 0, "KV pressure never preempted a request"
