"""Structured output over HTTP with the official client, on a real `lorapipe serve` (CPU, tiny model, one
adapter): OpenAI's response_format (json_schema, json_object) and vLLM's guided_json, guided_regex,
guided_choice and structured_outputs, completions and chat, streaming and not, greedy and sampled. Every
output is checked by an independent judge (`jsonschema`, `re.fullmatch`, membership); bad schemas and
regexes are a 400 naming the field that carried them."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
# bounded, so a random model's output ends inside max_tokens: the grammar allows nothing else
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["answer", "count", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}(!|\?)"
CHOICES = ["apple", "banana pie", 'say "hi"\n']


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters):
    with serve(tiny_llama, {"full8": llama_adapters["full8"]}, "--served-model-name", MODEL) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _run(oa: openai.OpenAI, chat: bool, stream: bool, model: str, **kw) -> tuple[str, str]:
    """One choice's text and finish reason."""
    if chat:
        messages = [{"role": "user", "content": "Give me the record."}]
        out = oa.chat.completions.create(model=model, messages=messages, stream=stream, **kw)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        chunks = list(out)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    out = oa.completions.create(model=model, prompt="The record:", stream=stream, **kw)
    if not stream:
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = list(out)
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


CASES = [  # (route, stream, model, sampling)
    (False, False, MODEL, {"temperature": 0}),
    (False, True, "full8", {"temperature": 1.0, "seed": 5}),
    (True, False, "full8", {"temperature": 0}),
    (True, True, MODEL, {"temperature": 1.2, "seed": 7}),
]
IDS = ["completions", "completions-stream", "chat", "chat-stream"]


@pytest.mark.parametrize(("chat", "stream", "model", "sampling"), CASES, ids=IDS)
def test_json_schema_outputs_validate(server, chat, stream, model, sampling):
    oa = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    asks = [{"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}]
    if chat:
        asks.append({"response_format": fmt})
    for ask in asks:
        if "response_format" in ask:
            text, reason = _run(oa, chat, stream, model, max_tokens=120, response_format=fmt, **sampling)
        else:
            text, reason = _run(oa, chat, stream, model, max_tokens=120, extra_body=ask, **sampling)
        assert reason == "stop", (ask, text)
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(("chat", "stream", "model", "sampling"), CASES, ids=IDS)
def test_regex_and_choice_outputs_match(server, chat, stream, model, sampling):
    oa = client(server)
    ask = {"guided_regex": REGEX, "guided_decoding_backend": "auto"}
    text, reason = _run(oa, chat, stream, model, max_tokens=40, extra_body=ask, **sampling)
    assert reason == "stop" and re.fullmatch(REGEX, text), text
    for ask in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
        text, reason = _run(oa, chat, stream, model, max_tokens=40, extra_body=ask, **sampling)
        assert reason == "stop" and text in CHOICES, text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_json_object_is_an_object(server, tiny_llama, chat):
    """Any JSON object: a bias against every token with a quote leaves the grammar one way to close it,
    so the output is complete within max_tokens whatever the random model prefers."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    quotes = {str(i): -100 for t, i in tok.get_vocab().items() if '"' in tok.decode([i])}
    assert 0 < len(quotes) <= 1024
    oa = client(server)
    fmt = {"type": "json_object"}
    kw = {"max_tokens": 30, "temperature": 0, "logit_bias": quotes}
    if chat:
        text, reason = _run(oa, chat, False, MODEL, response_format=fmt, **kw)
    else:
        text, reason = _run(oa, chat, False, MODEL, extra_body={"response_format": fmt}, **kw)
    assert reason == "stop" and isinstance(json.loads(text), dict), text


BAD = [
    ({"guided_regex": "a+("}, "guided_regex", "unclosed group"),
    ({"guided_json": {"type": "objekt"}}, "guided_json", "objekt"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "choices"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar", "not supported"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bad_grammars_are_refused_naming_their_field(server, chat):
    oa = client(server)
    for body, param, words in BAD:
        with pytest.raises(openai.BadRequestError) as info:
            _run(oa, chat, False, MODEL, max_tokens=4, extra_body=body)
        error = info.value.body
        assert error["param"] == param and words in error["message"], (body, error)


def test_the_sdk_takes_the_same_grammars(server):
    """`guided` among the SDK's sampling values; a bad one is refused by the tokenizer stage's check."""
    from runtime.client import InvalidRequest

    with server.client() as c:
        out = c.generate("The record:", "full8", max_tokens=40, guided={"kind": "regex", "spec": REGEX})
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
        spec = json.dumps(SCHEMA)
        out = c.generate(
            "The record:", max_tokens=120, temperature=1.0, guided={"kind": "json", "spec": spec}
        )
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
        with pytest.raises(InvalidRequest, match="(?s)guided: .*unclosed group"):
            c.generate("x", max_tokens=4, guided={"kind": "regex", "spec": "a+("})
