"""The offline engine with an 8-bit adapter pool (`lora_dtype="fp8"` or "int8") against the same engine
with a pool in the model's dtype: each adapter's effect on the last token's logits within 8-bit rounding,
base-only rows identical, and the pool holding 8-bit rows at about half the bytes a rank row."""

from __future__ import annotations

import pytest
import torch

from proto.sampling import SamplingParams
from runtime.offline import LLM
from stages.worker.runner import SeqInput

IDS = [5, 17, 42, 99, 7, 3, 250, 11, 64]


def _logits(llm: LLM, name: str | None) -> torch.Tensor:
    seq = [SeqInput(IDS, 0, [0], -1 if name is None else 0)]
    if name is not None:
        llm.runner.load_adapter(0, llm.adapters[name], [(0, llm.adapters[name].rank)])
    return llm.runner.execute(seq)[0].float().cpu()


@pytest.mark.parametrize("lora_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp8_pool_engine_close_to_the_model_dtype_pool(tiny_llama, llama_adapters, device, lora_dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = dict(device=device, adapters=llama_adapters, max_lora_rank=16, dtype="bfloat16")
    ref = LLM(tiny_llama, **kw)
    fp8 = LLM(tiny_llama, lora_dtype=lora_dtype, **kw)
    want_dtype = torch.float8_e4m3fn if lora_dtype == "fp8" else torch.int8
    assert fp8.runner.pool.mem.dtype == want_dtype and ref.runner.pool.mem.dtype == torch.bfloat16
    assert 1.9 < ref.runner.pool.row_nbytes / fp8.runner.pool.row_nbytes < 2.0
    base = _logits(ref, None)
    assert torch.equal(_logits(fp8, None), base)  # no adapter: the pool is never read
    for name in llama_adapters:
        want, got = _logits(ref, name), _logits(fp8, name)
        effect = (want - base).norm()
        assert effect > 0.05 * base.norm(), f"{name}: the adapter must move the logits"
        err = ((got - want).norm() / effect).item()
        assert err < 0.15, f"{name}: fp8 pool changes the adapter's effect by {err:.3f}"
    out = fp8.generate([IDS], adapters=[next(iter(llama_adapters))], sampling=SamplingParams(max_tokens=4))
    assert len(out[0].token_ids) == 4 and out[0].error is None
