"""An fp8 checkpoint over two tensor-parallel ranks (gloo, two processes on the CPU): each rank holds
its rows of Q/K/V and gate/up with their scales and its columns of O and down with every row's scale;
the logits of a batch mixing adapters and base-only requests agree with transformers + PEFT on the
checkpoint's dequantized copy up to the activations' per-token fp8 rounding, with the same greedy
tokens wherever PEFT's winner is clear."""

from __future__ import annotations

import pytest
import torch

from proto.sampling import SamplingParams
from runtime.offline import LLM
from runtime.synthetic.fp8 import write_dequantized, write_fp8
from stages.worker.model.linear import Fp8Weight
from tests.peft_reference import PeftReference
from tests.runtime.test_offline_vs_peft import PROMPTS


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def fp8_llama(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_fp8")
    fp8 = write_fp8(tiny_llama, root / "fp8", "compressed-tensors", "channel")
    return fp8, write_dequantized(fp8, root / "dequantized", torch.float32)


def test_two_ranks_of_an_fp8_checkpoint_match_peft_on_its_dequantized_copy(
    fp8_llama, llama_adapters, recorded_logits
):
    fp8, deq = fp8_llama
    names = list(llama_adapters)
    mix = [names[i % len(names)] if i % 3 != 2 else None for i in range(len(PROMPTS))]
    with LLM(fp8, device="cpu", adapters=llama_adapters, dtype="float32", tensor_parallel_size=2,
             max_lora_rank=16) as llm:  # fmt: skip
        assert isinstance(llm.runner.model.w.layers[0].down, Fp8Weight)
        outs = llm.generate(PROMPTS, adapters=mix, sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    ref = PeftReference(deq, llama_adapters)
    rows = [recorded_logits[r] for r in sorted(recorded_logits, key=lambda r: int(r[1:]))]
    for out, name, steps in zip(outs, mix, rows, strict=True):
        want = ref.logits(out.prompt_token_ids + out.token_ids[:-1], name)[len(out.prompt_token_ids) - 1 :]
        for step, (got, exp) in enumerate(zip(steps, want, strict=True)):
            assert _rel(got, exp) < 0.1, f"adapter {name} step {step}: {_rel(got, exp):.2e}"
            top2 = exp.topk(2).values
            if top2[0] - top2[1] > 0.5:
                assert int(got.argmax()) == int(exp.argmax()), f"adapter {name} step {step}"
