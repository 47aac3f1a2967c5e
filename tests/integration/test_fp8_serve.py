"""`lorapipe serve --quantization fp8` end to end (a subprocess, CPU, tiny bf16 model with adapters): its
greedy outputs equal the offline engine's with the same option, each request with its own adapter. The
offline engine runs each request alone, as the server (sent one request at a time) does: the fp8 GEMM's
arithmetic depends on the step's token count (weight-only up to kernels.fp8_gemm.MAX_M tokens, the
activations quantized beyond), so a batch of all the prompts would round differently."""

from __future__ import annotations

import pytest

from proto.sampling import SamplingParams
from runtime.offline import LLM
from runtime.synthetic.model import make_model
from tests.conftest import mixed_adapters
from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The river carried the boat", "Stories begin when", "Numbers: one two three", "Once upon a time"]
FLAGS = ("--quantization", "fp8", "--max-lora-rank", "16", "--num-pages", "128")


def test_fp8_server_matches_the_offline_fp8_engine(tmp_path):
    model = make_model(tmp_path / "bf16", preset="tiny", dtype="bfloat16", seed=11)
    adapters = mixed_adapters(model, tmp_path / "adapters")
    names = [*adapters, None]
    work = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS + PROMPTS[:1])]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for quantization in (None, "fp8"):
        with LLM(model, device="cpu", adapters=adapters, quantization=quantization, max_lora_rank=16) as llm:
            outs[quantization] = [llm.generate([p], adapters=[a], sampling=sampling)[0] for p, a in work]
    want = outs["fp8"]
    # the option shows in the tokens: a server that ignored it would fail below
    assert any(a.token_ids != b.token_ids for a, b in zip(outs[None], want, strict=True))
    with serve(model, adapters, *FLAGS) as server, server.client() as c:
        for (prompt, adapter), out in zip(work, want, strict=True):
            got = c.generate(prompt, adapter=adapter, max_tokens=6, ignore_eos=True)
            assert got.token_ids == out.token_ids, (prompt, adapter)
