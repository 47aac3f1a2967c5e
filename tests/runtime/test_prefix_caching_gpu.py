"""On a GPU: prefix caching with the engine's CUDA defaults (Triton attention and LoRA kernels, step and
decode graphs, overlapped scheduling). Requests of several adapters and the base model that share token
prefixes give PEFT's logits (the graphed paths' tolerance) and the greedy tokens of --no-prefix-caching;
shared pages keep their bytes. Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import pool_gb
from tests.runtime.test_prefix_caching_vs_peft import (
    PREFIX,
    _batch,
    _cached_rows,
    _errors,
    _llm,
    _run,
    peft_ref,
)
from tests.stages.worker.graph_tolerances import TOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
__all__ = ["peft_ref"]  # the module fixture, shared with the CPU tests


def _gpu_llm(model, adapters, **kw):
    base = dict(device="cuda", lora_backend="triton", attention_backend=None, pointwise_backend=None,
                num_pages=512, lora_gpu_memory_gb=pool_gb(model, 16 * len(adapters)))  # fmt: skip
    return _llm(model, adapters, **{**base, **kw})


def test_cached_outputs_equal_uncached_and_peft_on_cuda(
    tiny_llama, llama_adapters, recorded_logits, peft_ref
):
    names = list(llama_adapters)
    prompts, mix = _batch(names)
    plain = _gpu_llm(tiny_llama, llama_adapters, prefix_caching=False)
    base_outs, _ = _run(plain, recorded_logits, prompts, mix)
    llm = _gpu_llm(tiny_llama, llama_adapters, max_tokens_per_step=24, max_running_requests=4)
    for _ in range(2):  # the second call finds every prefix cached
        outs, logits = _run(llm, recorded_logits, prompts, mix)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base_outs]
        errs = _errors(peft_ref, outs, logits, mix)
        assert max(errs) < TOL, f"relative errors against PEFT: {errs}"
    assert llm.kv_pages.stats.hits >= len(prompts) * 4


def test_shared_pages_keep_their_bytes_on_cuda(tiny_llama, llama_adapters, recorded_logits, peft_ref):
    name = list(llama_adapters)[0]
    llm = _gpu_llm(tiny_llama, llama_adapters)
    _run(llm, recorded_logits, [PREFIX + [7, 8, 9]], [name])
    rows = _cached_rows(llm, PREFIX, name).cuda()
    k0, v0 = llm.runner.kv.k[:, rows].clone(), llm.runner.kv.v[:, rows].clone()
    sharers = [PREFIX + [7, 8, 9], PREFIX + [7, 8, 9, 10, 12, 99], PREFIX + [40]]
    outs, logits = _run(llm, recorded_logits, sharers, [name] * 3)
    assert torch.equal(llm.runner.kv.k[:, rows], k0) and torch.equal(llm.runner.kv.v[:, rows], v0)
    assert max(_errors(peft_ref, outs, logits, [name] * 3)) < TOL
