"""Structured output and logprobs through the offline engine (CPU, tiny model, one adapter), overlapped
and serial. Greedy guided decoding yields exactly the tokens of transformers + PEFT logits restricted to
what llguidance's own matcher allows at each step (its byte mask, not the engine's packed one); sampled
guided outputs match their grammar; a request without a grammar beside them is untouched. Logprobs in
RequestOutput equal a float64 log-softmax of PEFT logits."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from proto.sampling import Guided, SamplingParams
from runtime.common.grammar import grammar_of, matcher_tokenizer
from runtime.offline import LLM
from tests.peft_reference import PeftReference

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]"
PROMPT = "The river carried the boat"


@pytest.fixture(scope="module", params=[True, False], ids=["overlapped", "serial"])
def engine(request, tiny_llama, llama_adapters):
    adapters = {"full8": llama_adapters["full8"]}
    llm = LLM(tiny_llama, adapters=adapters, max_lora_rank=16, overlap_schedule=request.param)
    return llm, PeftReference(tiny_llama, adapters)


def check_guided_text(kind: str, text: str) -> None:
    """`text` follows the test grammar of `kind` (SCHEMA, REGEX, or the two choices)."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in ("left bank", "right bank")


def _greedy_guided(ref: PeftReference, llm: LLM, prompt: list[int], guided: Guided, adapter: str | None):
    """Greedy decoding of PEFT logits under llguidance's byte-per-token mask, until the grammar stops."""
    cfg = llm.runner.model_cfg
    tok = matcher_tokenizer(llm.tokenizer.to_str(), cfg.vocab_size, cfg.eos_token_ids)
    matcher = llguidance.LLMatcher(tok, grammar_of(guided))
    out: list[int] = []
    while not matcher.is_stopped():
        logits = ref.logits(prompt + out, adapter)[-1].double()  # [V]
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) > 0
        t = int(logits.masked_fill(~allowed[: logits.shape[0]], float("-inf")).argmax())
        out.append(t)
        assert matcher.consume_token(t)
        if t in cfg.eos_token_ids:
            break
    return out


def test_guided_outputs_follow_their_grammar(engine):
    llm, ref = engine
    prompt = llm.tokenizer.encode(PROMPT).ids
    json_g = Guided("json", json.dumps(SCHEMA))
    regex_g = Guided("regex", REGEX)
    choice_g = Guided("choice", json.dumps(["left bank", "right bank"]))
    cases = [
        ("full8", SamplingParams(max_tokens=40, guided=json_g)),
        (None, SamplingParams(max_tokens=40, guided=regex_g)),
        ("full8", SamplingParams(max_tokens=40, temperature=1.0, seed=3, guided=json_g)),
        (None, SamplingParams(max_tokens=40, temperature=1.5, seed=4, guided=regex_g)),
        ("full8", SamplingParams(max_tokens=40, temperature=1.0, seed=5, guided=choice_g)),
        ("full8", SamplingParams(max_tokens=6, ignore_eos=True)),
    ]
    outs = llm.generate([prompt] * len(cases), [a for a, _ in cases], [p for _, p in cases])
    for (adapter, p), out in zip(cases, outs, strict=True):
        assert out.error is None, out.error
        if p.guided is None:
            assert len(out.token_ids) == 6 and out.finish_reason == "length"
            continue
        assert out.finish_reason == "stop", (p, out.text)
        if p.greedy:
            assert out.token_ids == _greedy_guided(ref, llm, prompt, p.guided, adapter)
        check_guided_text(p.guided.kind, out.text)


def test_bad_grammars_are_refused_before_running(engine):
    llm, _ = engine
    with pytest.raises(ValueError, match="(?s)guided: .*unclosed group"):
        llm.generate("hi", sampling=SamplingParams(guided=Guided("regex", "a(")))


def test_request_output_carries_logprobs(engine):
    llm, ref = engine
    prompt = llm.tokenizer.encode(PROMPT).ids
    k, n = 3, 5
    asks = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=k)
    outs = llm.generate([prompt, prompt], ["full8", None], [asks, SamplingParams(max_tokens=n)])
    assert outs[1].logprobs is None
    out = outs[0]
    rows = torch.log_softmax(ref.logits(prompt + out.token_ids, "full8")[len(prompt) - 1 : -1].double(), -1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == n
    for lp, t, row in zip(out.logprobs, out.token_ids, rows, strict=True):
        assert abs(lp.logprob - float(row[t])) < 1e-3
        want = row.topk(k)
        assert lp.top_ids == want.indices.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, want.values.tolist(), strict=True)) < 1e-3


def _check_prompt_logprobs(lps, prompt: list[int], rows: torch.Tensor, k: int) -> None:
    """vLLM's prompt_logprobs (without its leading None) against float64 reference rows [L - 1, V]."""
    assert lps is not None and len(lps) == len(prompt) - 1
    for lp, t, row in zip(lps, prompt[1:], rows, strict=True):
        v = float(row[t])
        assert abs(lp.logprob - v) < 1e-3
        # ties within float32 error may order either way
        assert int((row > v + 1e-4).sum()) + 1 <= lp.rank <= int((row > v - 1e-4).sum()) + 1
        want = row.topk(k)
        assert lp.top_ids == want.indices.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, want.values.tolist(), strict=True)) < 1e-3


def test_prompt_logprobs_match_peft_across_prefill_chunks(tiny_llama, llama_adapters):
    """Prompts longer than a step's token budget are prefilled in chunks: every chunk's positions are
    reported once, in order; a batch-mate that does not ask gets none and the same tokens as alone."""
    adapters = {"full8": llama_adapters["full8"]}
    llm = LLM(tiny_llama, adapters=adapters, max_lora_rank=16, max_tokens_per_step=16, max_running_requests=4)
    ref = PeftReference(tiny_llama, adapters)
    long = llm.tokenizer.encode(" ".join([PROMPT, "and the wind"] * 4)).ids
    short = llm.tokenizer.encode(PROMPT).ids
    assert len(long) > 2 * 16
    k = 4
    asks = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k)
    plain = SamplingParams(max_tokens=3, ignore_eos=True)
    alone = llm.generate([short], [None], [plain])[0]
    outs = llm.generate([long, short, short], ["full8", None, "full8"], [asks, plain, asks])
    assert outs[1].prompt_logprobs is None and outs[1].token_ids == alone.token_ids
    for out, prompt, adapter in ((outs[0], long, "full8"), (outs[2], short, "full8")):
        rows = torch.log_softmax(ref.logits(prompt, adapter)[:-1].double(), -1)  # [L - 1, V]
        _check_prompt_logprobs(out.prompt_logprobs, prompt, rows, k)


def test_prompt_logprobs_are_whole_when_the_prefix_is_cached(tiny_llama, llama_adapters):
    """A prompt whose pages an earlier request cached (same adapter, same tokens) is still computed at
    every position when it asks for its prompt's logprobs: a cache hit would leave them out."""
    adapters = {"full8": llama_adapters["full8"]}
    llm = LLM(tiny_llama, adapters=adapters, max_lora_rank=16, page_size=4)
    prompt = llm.tokenizer.encode(" ".join([PROMPT, "and the wind"] * 2)).ids
    plain = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate([prompt], ["full8"], [plain])
    hits = llm.kv_pages.stats.hits
    asks = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    (out,) = llm.generate([prompt], ["full8"], [asks])
    assert llm.kv_pages.stats.hits == hits, "the request that asks hit the prefix cache"
    llm.generate([prompt], ["full8"], [plain])
    assert llm.kv_pages.stats.hits > hits, "the prompt's pages were not cached: nothing was tested"
    rows = torch.log_softmax(PeftReference(tiny_llama, adapters).logits(prompt, "full8")[:-1].double(), -1)
    _check_prompt_logprobs(out.prompt_logprobs, prompt, rows, 3)
