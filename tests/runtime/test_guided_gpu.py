"""On a GPU: structured output through the offline engine with CUDA graphs and overlapped scheduling
(masks unpacked on the device, the step before's tokens read while the forward runs). Outputs validate
with jsonschema and match their regex and choices; a request without a grammar yields the same tokens
beside guided batch-mates as alone; logprobs ride along. Runs only where CUDA is available."""

from __future__ import annotations

import json

import pytest
import torch

from proto.sampling import Guided, SamplingParams
from runtime.offline import LLM
from tests.runtime.test_offline_guided import REGEX, SCHEMA, check_guided_text

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_guided_outputs_on_cuda(tiny_llama, llama_adapters):
    adapters = {"full8": llama_adapters["full8"]}
    llm = LLM(
        tiny_llama, adapters=adapters, device="cuda", max_lora_rank=16, num_pages=256, lora_gpu_memory_gb=0.05
    )
    prompt = llm.tokenizer.encode("The river carried the boat").ids
    plain = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    alone = llm.generate([prompt], ["full8"], [plain])[0]
    json_g, regex_g = Guided("json", json.dumps(SCHEMA)), Guided("regex", REGEX)
    choice_g = Guided("choice", json.dumps(["left bank", "right bank"]))
    cases = [(None, plain), ("full8", plain)]
    for i in range(24):  # enough rows for a few graph batch sizes
        g = (json_g, regex_g, choice_g)[i % 3]
        temperature = 0.0 if i % 2 else 1.0
        cases.append(
            (
                "full8" if i % 4 else None,
                SamplingParams(max_tokens=40, temperature=temperature, seed=i, guided=g),
            )
        )
    outs = llm.generate([prompt] * len(cases), [a for a, _ in cases], [p for _, p in cases])
    assert outs[1].token_ids == alone.token_ids
    assert outs[1].logprobs is not None and len(outs[1].logprobs) == 12
    for (_, p), out in zip(cases, outs, strict=True):
        assert out.error is None, out.error
        if p.guided is None:
            continue
        assert out.finish_reason == "stop", (p.guided.kind, out.text)
        check_guided_text(p.guided.kind, out.text)


def test_prompt_logprobs_on_cuda_match_peft(tiny_llama, llama_adapters):
    """Chunked prefill on the device (eager steps with the prompt positions' logits) against float64
    log-softmax of transformers + PEFT logits on the CPU; near-ties may order either way."""
    from tests.peft_reference import PeftReference

    adapters = {"full8": llama_adapters["full8"]}
    llm = LLM(
        tiny_llama, adapters=adapters, device="cuda", max_lora_rank=16, max_tokens_per_step=16,
        max_running_requests=4, num_pages=256, lora_gpu_memory_gb=0.05,
    )  # fmt: skip
    ref = PeftReference(tiny_llama, adapters)
    prompt = llm.tokenizer.encode("The river carried the boat and the wind " * 4).ids
    k, tol = 3, 2e-3
    p = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=k)
    out = llm.generate([prompt, prompt], ["full8", None], [p, SamplingParams(max_tokens=2)])
    assert out[1].prompt_logprobs is None
    rows = torch.log_softmax(ref.logits(prompt, "full8")[:-1].double(), -1)  # [L - 1, V]
    lps = out[0].prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) - 1
    for lp, t, row in zip(lps, prompt[1:], rows, strict=True):
        v = float(row[t])
        assert abs(lp.logprob - v) < tol
        assert int((row > v + tol).sum()) + 1 <= lp.rank <= int((row > v - tol).sum()) + 1
        want = row.topk(k).values.tolist()
        assert all(abs(a - b) < tol for a, b in zip(lp.top_logprobs, want, strict=True))
        assert all(abs(float(row[i]) - a) < tol for i, a in zip(lp.top_ids, lp.top_logprobs, strict=True))
