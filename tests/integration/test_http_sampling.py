"""Sampling options over HTTP and the SDK against transformers + PEFT on a real `lorapipe serve` (CPU,
tiny model, one adapter), greedy: penalties and logit bias against PEFT logits adjusted by the plain
reference (tests/sampling_reference.py), and logprobs against a float64 log-softmax of PEFT logits,
completions and chat, streaming and not."""

from __future__ import annotations

import openai
import pytest

from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters):
    with serve(tiny_llama, {"full8": llama_adapters["full8"]}, "--served-model-name", "tiny") as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def peft(tiny_llama, llama_adapters):
    """transformers + PEFT on the server's model and its adapter, and transformers' tokenizer."""
    from transformers import AutoTokenizer

    from tests.peft_reference import PeftReference

    ref = PeftReference(tiny_llama, {"full8": llama_adapters["full8"]})
    return ref, AutoTokenizer.from_pretrained(str(tiny_llama))


def test_penalties_and_bias_over_http_match_the_reference(server, peft):
    """Greedy, through the official client: each request's tokens equal transformers + PEFT logits
    adjusted by the plain reference, and differ from the unadjusted ones (the premise)."""
    from proto.sampling import SamplingParams
    from tests.sampling_reference import greedy_adjusted

    n, oa = 8, client(server)
    ref, hf = peft
    prompt = hf("The river carried the boat")["input_ids"]
    plain = greedy_adjusted(ref, prompt, n, "full8", SamplingParams())
    cases = [
        ({"frequency_penalty": 2.0, "presence_penalty": 1.0}, {}),
        ({"logit_bias": {str(plain[0]): -100}}, {"repetition_penalty": 3.0}),
    ]
    for fields, extra in cases:
        out = oa.completions.create(
            model="full8", prompt=prompt, max_tokens=n, temperature=0, **fields,
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        )  # fmt: skip
        bias = {int(k): float(v) for k, v in fields.get("logit_bias", {}).items()}
        p = SamplingParams(
            frequency_penalty=fields.get("frequency_penalty", 0.0),
            presence_penalty=fields.get("presence_penalty", 0.0),
            repetition_penalty=extra.get("repetition_penalty", 1.0),
            logit_bias=bias or None,
        )
        expected = greedy_adjusted(ref, prompt, n, "full8", p)
        assert out.choices[0].model_extra["token_ids"] == expected != plain, fields
    messages = [{"role": "user", "content": "Tell me about rivers"}]
    chat_prompt = hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = oa.chat.completions.create(
        model="full8", messages=messages, max_tokens=n, temperature=0, frequency_penalty=2.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    p = SamplingParams(frequency_penalty=2.0)
    assert out.choices[0].model_extra["token_ids"] == greedy_adjusted(ref, chat_prompt, n, "full8", p)


def _reference_logprobs(ref, prompt: list[int], output: list[int], adapter: str | None):
    """Per output position: the float64 log-softmax of transformers + PEFT logits."""
    import torch

    rows = ref.logits(prompt + output, adapter)[len(prompt) - 1 : -1].double()  # [n, V]
    return torch.log_softmax(rows, dim=-1)


class _Names(dict):
    """Token id -> its decoded text (by transformers' tokenizer), for any id the logits have."""

    def __init__(self, hf) -> None:
        super().__init__()
        self.hf = hf

    def __missing__(self, t: int) -> str:
        self[t] = self.hf.decode([t])
        return self[t]


def _check(lps, ids: list[int], expected, k: int) -> None:
    """(logprob, top ids, top logprobs) per token against the reference rows: values within 1e-3
    (float32 serving against float64), the top ids as the reference ranks them."""
    assert len(lps) == len(ids) == expected.shape[0] and ids
    for (logprob, top_ids, top_values), t, row in zip(lps, ids, expected, strict=True):
        assert abs(logprob - float(row[t])) < 1e-3
        want = row.topk(k)
        assert top_ids == want.indices.tolist()
        assert max(abs(a - b) for a, b in zip(top_values, want.values.tolist(), strict=True)) < 1e-3


def test_logprobs_match_a_float64_log_softmax_of_peft_logits(server, peft):
    """Completions and chat, streaming and not, and the SDK: each output token's log-probability and
    the k likeliest tokens' equal transformers + PEFT's, and tokens are named by their decoded text."""
    ref, hf = peft
    oa, n, k = client(server), 5, 3
    prompt = hf("The river carried the boat")["input_ids"]
    messages = [{"role": "user", "content": "Tell me about rivers"}]
    chat_prompt = hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    common = {"model": "full8", "max_tokens": n, "temperature": 0}
    common["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
    name = _Names(hf)
    for stream in (False, True):
        out = oa.completions.create(prompt=prompt, logprobs=k, stream=stream, **common)
        choices = [c.choices[0] for c in out] if stream else [out.choices[0]]
        ids = [t for c in choices for t in c.model_extra["token_ids"]]
        got = [c.logprobs for c in choices if c.logprobs is not None]
        tokens = [t for g in got for t in g.tokens]
        values = [v for g in got for v in g.token_logprobs]
        tops = [d for g in got for d in g.top_logprobs]
        offsets = [o for g in got for o in g.text_offset]
        expected = _reference_logprobs(ref, prompt, ids, "full8")
        assert len(values) == len(ids) == len(tops) == n and tokens == [name[t] for t in ids]
        for v, t, top, row in zip(values, ids, tops, expected, strict=True):
            assert abs(v - float(row[t])) < 1e-3
            named: dict[str, float] = {}  # {name: value}: tokens whose names coincide share one entry
            want = row.topk(k)
            for i, w in zip(want.indices.tolist(), want.values.tolist(), strict=True):
                named.setdefault(name[i], w)
            assert top.keys() == named.keys() and all(abs(top[s] - named[s]) < 1e-3 for s in top)
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]

        out = oa.chat.completions.create(
            messages=messages, logprobs=True, top_logprobs=k, stream=stream, **common
        )
        choices = [c.choices[0] for c in out if c.choices] if stream else [out.choices[0]]
        ids = [t for c in choices for t in c.model_extra.get("token_ids") or []]
        content = [e for c in choices if c.logprobs is not None for e in c.logprobs.content]
        expected = _reference_logprobs(ref, chat_prompt, ids, "full8")
        top_ids = [row.topk(k).indices.tolist() for row in expected]
        lps = [
            (e.logprob, t, [x.logprob for x in e.top_logprobs]) for e, t in zip(content, top_ids, strict=True)
        ]
        _check(lps, ids, expected, k)
        assert [e.token for e in content] == [name[t] for t in ids]
        assert [[x.token for x in e.top_logprobs] for e in content] == [
            [name[t] for t in ts] for ts in top_ids
        ]
    with server.client() as c:
        out = c.generate(prompt, "full8", max_tokens=n, logprobs=k, ignore_eos=True)
    expected = _reference_logprobs(ref, prompt, out.token_ids, "full8")
    _check([(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in out.logprobs], out.token_ids, expected, k)


def test_prompt_logprobs_match_a_float64_log_softmax_of_peft_logits(server, peft):
    """vLLM's prompt_logprobs on completions: None for the first prompt token, then {token id: entry}
    with the token's own log-probability and rank and the k likeliest tokens', each against transformers
    + PEFT; a streamed request or a chat request asking for them is refused by name."""
    ref, hf = peft
    oa, k = client(server), 3
    prompt = hf("The river carried the boat down to the sea")["input_ids"]
    out = oa.completions.create(
        model="full8", prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": k}
    )
    got = out.choices[0].model_extra["prompt_logprobs"]
    rows = _reference_logprobs(ref, prompt[:1], prompt[1:], "full8")  # [L - 1, V]
    assert got[0] is None and len(got) == len(prompt)
    for entry, t, row in zip(got[1:], prompt[1:], rows, strict=True):
        v = float(row[t])
        own = entry[str(t)]
        assert abs(own["logprob"] - v) < 1e-3 and own["decoded_token"] == hf.decode([t])
        assert int((row > v + 1e-4).sum()) + 1 <= own["rank"] <= int((row > v - 1e-4).sum()) + 1
        want = row.topk(k)
        assert set(entry) == {str(t)} | {str(i) for i in want.indices.tolist()}
        for rank, (i, w) in enumerate(zip(want.indices.tolist(), want.values.tolist(), strict=True), 1):
            if i != t:
                assert entry[str(i)]["rank"] == rank and abs(entry[str(i)]["logprob"] - w) < 1e-3
    plain = oa.completions.create(model="full8", prompt=prompt, max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    for call in (
        lambda: oa.completions.create(
            model="full8", prompt=prompt, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        ),
        lambda: oa.chat.completions.create(
            model="full8", messages=[{"role": "user", "content": "x"}], extra_body={"prompt_logprobs": 1}
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == "prompt_logprobs"
