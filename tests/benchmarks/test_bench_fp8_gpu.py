"""The CPU emulation of the fp8 base (float32 sums of e4m3 products, scaled per token and per channel,
rounded to bf16) is the CUDA path's arithmetic: on one checkpoint and one adapter, fp8's error against
bf16, layer by layer and in the next-token distributions, is the same measured on either device.
Rounding to e4m3 another way (truncating) or a misapplied scale would move the CUDA error by more
than the bound. (The two devices' fp8 states themselves differ: a bf16-level difference of an input
moves some values across an e4m3 rounding boundary, by a whole e4m3 step.)"""

from __future__ import annotations

import pytest
import torch

from benchmarks.fp8_quality import (
    PairStats,
    forward_states,
    load_adapters,
    make_checkpoint,
    model_config,
    quality_engine,
)
from runtime.synthetic.adapters import make_adapters

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]

SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000)  # fmt: skip


def test_cpu_emulation_is_the_cuda_arithmetic(tmp_path):
    model = make_checkpoint(tmp_path / "m", model_config("1b", SHAPE), "random", "cpu")
    paths = make_adapters(model, tmp_path / "a", n=1, ranks=(16,), dtype="bfloat16", seed=0)
    adapters = {p.name: p for p in paths}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 32000, (128,), generator=g).tolist() for _ in range(3)]
    stats = {}
    for device in ("cpu", "cuda"):
        engines = {k: quality_engine(model, adapters, device, k) for k in ("bf16", "fp8")}
        load_adapters(engines, list(adapters))
        s = PairStats()
        for tokens in prompts:
            ref, got = (forward_states(engines[k], tokens, 0) for k in ("bf16", "fp8"))
            ref = (ref[0].cpu(), [h.cpu() for h in ref[1]])
            got = (got[0].cpu(), [h.cpu() for h in got[1]])
            s.add(ref, got)
        stats[device] = s.result()
        for llm in engines.values():
            llm.close()
        del engines
        torch.cuda.empty_cache()
    cpu, cuda = stats["cpu"], stats["cuda"]
    for layer, (a, b) in enumerate(zip(cpu["hidden_rel_err"][1:], cuda["hidden_rel_err"][1:], strict=True)):
        assert b == pytest.approx(a, rel=0.1), f"layer {layer + 1}: fp8 error {b:.4f} on CUDA, {a:.4f} on CPU"
    assert cuda["mean_kl"] == pytest.approx(cpu["mean_kl"], rel=0.25)
