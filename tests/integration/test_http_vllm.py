"""What a vLLM or OpenAI client sends to a real `lorapipe serve` (CPU, tiny model, default loading flags):
every field of the official client's completion and chat request schemas is honoured or refused by name
(the lists below), unknown fields are refused by name, vLLM's extensions that lorapipe supports pass;
runtime adapter loads are refused without a root; prompts over the byte limit are refused by their size
over HTTP as over the SDK, and an SDK message over the server's limit is a typed error."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# field -> a value this server honours (sent by the official client)
COMPLETION_SUPPORTED = {
    "model": MODEL,
    "prompt": "hello",
    "best_of": 1,
    "echo": True,
    "max_tokens": 2,
    "n": 1,
    "seed": 3,
    "stop": ["\n\n"],
    "stream_options": {"include_usage": True},  # with stream=True
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "someone",
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logit_bias": {"5": 10},
    "logprobs": 2,
}
CHAT_SUPPORTED = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_completion_tokens": 2,
    "max_tokens": 2,
    "n": 2,
    "seed": 3,
    "stop": "\n\n",
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "someone",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logit_bias": {"5": 10},
    "logprobs": True,
    "top_logprobs": 2,  # with logprobs (COMPANIONS)
    "response_format": {"type": "json_object"},  # outputs checked in test_http_structured.py
}
COMPANIONS = {"top_logprobs": {"logprobs": True}}  # what a supported field is sent with
# field -> a value that asks for something this server does not do: refused with a 400 naming the field
COMPLETION_REFUSED = {
    "suffix": "tail",
}
CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [TOOL["function"]],
    "metadata": {"a": "b"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "m"},
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "x"},
    "prompt_cache_options": {"x": 1},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "service_tier": "flex",
    "store": True,
    "tool_choice": "auto",
    "tools": [TOOL],
    "verbosity": "low",
    "web_search_options": {},
}
# vLLM's extensions (extra_body): supported ones pass, the others are refused by name
VLLM_SUPPORTED = {"top_k": 2, "stop_token_ids": [1], "ignore_eos": True, "return_token_ids": True}
VLLM_SUPPORTED |= {"repetition_penalty": 1.2, "min_p": 0.1}
VLLM_ROUTE_ONLY = {"prompt_logprobs": 1}  # completions honour it (test_http_sampling.py); chat refuses it
VLLM_REFUSED = {
    "min_tokens": 2,
    "guided_grammar": 'root ::= "a"',
    "guided_whitespace_pattern": " ",
    "guided_decoding_backend": "xgrammar",  # grammars run on llguidance here ("auto" passes)
    "use_beam_search": True,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
}


PROMPT_BYTES, REQUEST_BYTES = 20_000, 1 << 20
FLAGS = ("--served-model-name", MODEL, "--max-prompt-bytes", str(PROMPT_BYTES))
FLAGS += ("--max-request-bytes", str(REQUEST_BYTES))


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters):
    with serve(tiny_llama, {"full8": llama_adapters["full8"]}, *FLAGS) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def schema_fields(params: type) -> set[str]:
    """Every field of one of the official client's request TypedDicts (stream is in its subclasses)."""
    return set(params.__annotations__) | {"stream"}


@pytest.mark.parametrize(
    ("params", "supported", "refused"),
    [
        (completion_create_params.CompletionCreateParamsBase, COMPLETION_SUPPORTED, COMPLETION_REFUSED),
        (chat_create_params.CompletionCreateParamsBase, CHAT_SUPPORTED, CHAT_REFUSED),
    ],
    ids=["completions", "chat"],
)
def test_every_schema_field_is_listed_as_supported_or_refused(params, supported, refused):
    """A field the client gains (a newer openai) must be decided on here, not pass unnoticed."""
    listed = set(supported) | set(refused) | {"stream"}
    assert schema_fields(params) - listed == set(), "fields neither supported nor refused"
    assert set(supported) & set(refused) == set()


def _create(oa: openai.OpenAI, chat: bool, body: dict, extra: dict | None = None):
    stream = "stream_options" in body
    call = oa.chat.completions.create if chat else oa.completions.create
    out = call(**body, stream=stream, extra_body=extra)
    if stream:
        chunks = list(out)
        assert chunks and chunks[-1].usage is not None
        return chunks
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_supported_fields_are_honoured(server, chat):
    oa = client(server)
    supported = CHAT_SUPPORTED if chat else COMPLETION_SUPPORTED
    base = {k: supported[k] for k in ("model", "messages" if chat else "prompt")}
    base["max_tokens" if not chat else "max_completion_tokens"] = 2
    for name, value in supported.items():
        out = _create(oa, chat, {**base, **COMPANIONS.get(name, {}), name: value})
        if name == "n" and chat:
            assert len(out.choices) == 2
        if name == "echo":
            assert out.choices[0].text.startswith("hello")
    out = _create(oa, chat, base, VLLM_SUPPORTED | ({} if chat else VLLM_ROUTE_ONLY))
    assert 1 <= len(out.choices[0].model_extra["token_ids"]) <= 2


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_unsupported_fields_are_refused_by_name(server, chat):
    oa = client(server)
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    refused = CHAT_REFUSED if chat else COMPLETION_REFUSED
    vllm_refused = VLLM_REFUSED | (VLLM_ROUTE_ONLY if chat else {})
    for name, value in [*refused.items(), *vllm_refused.items()]:
        body, extra = ({**base, name: value}, None) if name in refused else (base, {name: value})
        with pytest.raises(openai.BadRequestError) as info:
            _create(oa, chat, body, extra)
        assert info.value.body["param"] == name, (name, info.value.body)
        assert name in info.value.body["message"]
    # neutral values ask for nothing: accepted
    neutral = {"tool_choice": "none", "logprobs": False, "store": False} if chat else {"logprobs": None}
    vllm_neutral = {"use_beam_search": False, "min_tokens": 0, "guided_grammar": None}
    assert _create(oa, chat, {**base, **neutral}, vllm_neutral).choices[0].finish_reason


def test_unknown_fields_are_refused_by_name(server):
    with httpx.Client(timeout=60) as h:
        for path, body in [
            ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temprature": 0.5}),
            ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "x": 1}),
            ("completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usge": True}}),
            ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x", "y": 1}]}),
        ]:
            r = h.post(f"{server.base_url}/{path}", json=body)
            error = r.json()["error"]
            assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
            assert error["code"] == "unknown_parameter" and error["param"] in error["message"]
            assert error["param"].split(".")[-1].split("[")[0] in ("temprature", "x", "include_usge", "y")


def test_runtime_loads_are_refused_without_a_root_with_one_text(server, llama_adapters):
    """Default flags: no --adapter-root and no --allow-any-adapter-path. Over HTTP and ZeroMQ, a real
    adapter, a directory without one and a missing path get the same refusal; the --adapter adapter
    given at start-up is served."""
    from runtime.client import Forbidden

    paths = [str(llama_adapters["qv5"]), "/etc", "/does/not/exist"]
    texts = set()
    with httpx.Client(timeout=60) as h:
        for path in paths:
            r = h.post(f"{server.base_url}/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
            assert r.status_code == 403, r.text
            texts.add(r.json()["error"]["message"])
    with server.client() as c:
        for path in paths:
            with pytest.raises(Forbidden) as info:
                c.load_adapter("late", path)
            texts.add(str(info.value))
    assert len(texts) == 1 and "--adapter-root" in texts.pop()
    out = client(server).completions.create(model="full8", prompt="hi", max_tokens=2)
    assert out.choices[0].finish_reason


def test_prompts_over_the_byte_limit_are_refused_by_size_before_tokenizing(server):
    """The byte check's text (not the context-length one, which needs the token count) proves the prompt
    was refused before it was tokenized, on both routes and the SDK."""
    from runtime.client import InvalidRequest

    oa, long = client(server), "word " * (PROMPT_BYTES // 5 + 10)
    with pytest.raises(openai.BadRequestError, match=f"limit of {PROMPT_BYTES} bytes") as info:
        oa.completions.create(model=MODEL, prompt=long, max_tokens=2)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match=f"limit of {PROMPT_BYTES} bytes") as info:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=2)
    assert info.value.body["param"] == "messages"
    with server.client() as c, pytest.raises(InvalidRequest, match=f"limit of {PROMPT_BYTES} bytes"):
        c.generate(long, max_tokens=2)


def test_sdk_messages_over_the_request_limit_are_a_typed_error(server):
    """A message over --max-request-bytes would make ZeroMQ drop the connection; the SDK refuses it by
    name and the same connection goes on serving."""
    from runtime.client import InvalidRequest

    with server.client() as c:
        for prompt in ["x" * (REQUEST_BYTES + 1), [5] * (REQUEST_BYTES // 4 + 1)]:
            with pytest.raises(InvalidRequest, match=f"at most {REQUEST_BYTES}.*--max-request-bytes"):
                c.generate(prompt, max_tokens=2)
        with pytest.raises(InvalidRequest, match=f"at most {REQUEST_BYTES}.*--max-request-bytes"):
            c.load_adapter("big", "p" * (REQUEST_BYTES + 1))
        assert c.generate("still serving", max_tokens=2).finish_reason


def test_tokenize_and_detokenize_as_vllm_and_transformers(server, tiny_llama):
    """vLLM's /tokenize and /detokenize shapes, ids and text equal to transformers' tokenizer of the same
    files, for the base model and an adapter by either name, and errors named."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    root = server.base_url.removesuffix("/v1")
    text, messages = "héllo wörld, numbers 123", [{"role": "user", "content": "Hi there"}]
    with httpx.Client(timeout=60) as h:
        for model in (None, MODEL, "full8", f"{MODEL}:full8"):
            body = {"prompt": text, "return_token_strs": True} | ({"model": model} if model else {})
            out = h.post(f"{root}/tokenize", json=body).json()
            ids = hf(text)["input_ids"]
            assert out == {
                "count": len(ids),
                "max_model_len": out["max_model_len"],
                "tokens": ids,
                "token_strs": hf.convert_ids_to_tokens(ids),
            }
            plain = h.post(f"{root}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
            assert plain["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
            assert plain["token_strs"] is None
        chat = h.post(f"{root}/tokenize", json={"model": "full8", "messages": messages}).json()
        ref = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert chat["tokens"] == ref and chat["count"] == len(ref)
        models = h.get(f"{server.base_url}/models").json()["data"]
        assert {m["max_model_len"] for m in models} == {chat["max_model_len"]}
        back = h.post(f"{root}/detokenize", json={"model": "full8", "tokens": ids}).json()
        assert back == {"prompt": hf.decode(ids)}
        for path, body, status, param in [
            ("tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
            ("tokenize", {"model": f"{MODEL}:nope", "prompt": "x"}, 404, "model"),
            ("tokenize", {"prompt": "x", "extra": 1}, 400, "extra"),
            ("tokenize", {"prompt": "word " * PROMPT_BYTES}, 400, "prompt"),
            ("tokenize", {"messages": messages, "chat_template": "{{ x }}"}, 400, "chat_template"),
            ("detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
            ("detokenize", {"tokens": "abc"}, 400, "tokens"),
        ]:
            r = h.post(f"{root}/{path}", json=body)
            assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)


def test_values_out_of_range_name_their_field(server):
    oa = client(server)
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    completion = {"model": MODEL, "max_tokens": 2, "prompt": "hi"}
    for call, body, extra, param in [
        (oa.completions.create, {**completion, "best_of": 3}, None, "best_of"),
        (oa.completions.create, {**completion, "logprobs": 2, "echo": True}, None, "echo"),
        (oa.completions.create, {**completion, "logprobs": 21}, None, "logprobs"),
        (oa.completions.create, {**completion, "presence_penalty": 3}, None, "presence_penalty"),
        (oa.completions.create, {**completion, "logit_bias": {"x": 1}}, None, "logit_bias"),
        (oa.completions.create, {**completion, "logit_bias": {"99999999": 1}}, None, "logit_bias"),
        (oa.completions.create, {**completion, "logit_bias": {"5": 101}}, None, "logit_bias"),
        (oa.completions.create, completion, {"repetition_penalty": 0}, "repetition_penalty"),
        (oa.completions.create, completion, {"min_p": 2}, "min_p"),
        (oa.chat.completions.create, {**chat, "top_logprobs": 2}, None, "top_logprobs"),
        (oa.chat.completions.create, {**chat, "logprobs": True, "top_logprobs": 30}, None, "top_logprobs"),
        (oa.chat.completions.create, {**chat, "frequency_penalty": -2.5}, None, "frequency_penalty"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            call(**body, extra_body=extra)
        assert info.value.body["param"] == param, (body, extra, info.value.body)
