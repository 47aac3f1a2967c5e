"""Penalties and logit bias end to end through the offline engine, greedy, against transformers + PEFT
logits adjusted by the plain reference (tests/sampling_reference.py), batched beside a request that
asks for none; each adjustment changes the output (the premise), so a sampler ignoring it fails."""

from __future__ import annotations

from proto.sampling import SamplingParams
from runtime.offline import LLM
from tests.peft_reference import PeftReference
from tests.sampling_reference import greedy_adjusted

N = 10
PROMPTS = ["The river carried the boat", "Numbers: one two three"]


def test_penalties_and_bias_match_the_reference(tiny_llama, llama_adapters):
    adapters = {"full8": llama_adapters["full8"]}
    llm = LLM(tiny_llama, adapters=adapters, max_lora_rank=16)
    ref = PeftReference(tiny_llama, adapters)
    prompt = [llm.tokenizer.encode(p).ids for p in PROMPTS]
    plain = SamplingParams(max_tokens=N, ignore_eos=True)
    first = greedy_adjusted(ref, prompt[0], 1, "full8", plain)[0]
    cases = [
        (prompt[0], "full8", SamplingParams(max_tokens=N, ignore_eos=True)),
        (prompt[0], "full8", SamplingParams(max_tokens=N, ignore_eos=True, frequency_penalty=2.0)),
        (prompt[1], None, SamplingParams(max_tokens=N, ignore_eos=True, presence_penalty=2.0)),
        (prompt[1], "full8", SamplingParams(max_tokens=N, ignore_eos=True, repetition_penalty=3.0)),
        (prompt[0], "full8", SamplingParams(max_tokens=N, ignore_eos=True, logit_bias={first: -100.0})),
    ]
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases])
    for (ids, adapter, p), out in zip(cases, outs, strict=True):
        expected = greedy_adjusted(ref, ids, N, adapter, p)
        assert out.token_ids == expected, p
        if p.adjusts_logits:  # the premise: the adjustment changed what greedy decoding yields
            assert expected != greedy_adjusted(ref, ids, N, adapter, plain), p
