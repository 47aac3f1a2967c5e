"""The OpenAI-compatible HTTP front end of a real `lorapipe serve` (CPU, tiny model), driven by the
official `openai` client: completions and chat, streaming and not, greedy tokens equal to the ZeroMQ
SDK's, 64 concurrent streams, typed errors, a disconnect mid-stream frees KV pages and slot references,
adapters loaded and unloaded over HTTP, and the gateway gauges on the HTTP port's /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.client import AsyncClient, Timeout
from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(300)

FLAGS = ("--max-loras-per-batch", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16", "--num-pages", "256")
PROMPTS = ["The river carried the boat", "Stories begin when", "héllo wörld", "Numbers: one two three"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters):
    flags = (*FLAGS, "--served-model-name", "tiny", "--allow-any-adapter-path")  # loads over HTTP
    with serve(tiny_llama, llama_adapters, *flags) as s:
        yield s


@pytest.fixture(scope="module")
def sdk_reference(server, llama_adapters):
    """Greedy token ids from the ZeroMQ SDK for every (prompt, adapter) the tests use."""
    names = [None, *llama_adapters]

    async def main():
        async with AsyncClient(server.endpoint, timeout=120) as c:
            keys = [(p, a) for p in PROMPTS for a in names]
            outs = await asyncio.gather(
                *(c.generate(p, a, max_tokens=MAX_TOKENS, ignore_eos=True) for p, a in keys)
            )
        return {k: (o.token_ids, o.text) for k, o in zip(keys, outs, strict=True)}

    try:
        return asyncio.run(main())
    except Timeout as exc:  # a hung fixture says where its requests were
        raise AssertionError(f"{exc}; the server's state:\n{server.snapshot()}") from exc


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120, **kw)


def model_of(adapter: str | None, style: str = "name") -> str:
    if adapter is None:
        return "tiny"
    return f"tiny:{adapter}" if style == "base:adapter" else adapter


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"


def test_completions_greedy_equal_the_sdk_for_adapters_and_base(
    server, sdk_reference, llama_adapters, tiny_llama
):
    from tokenizers import Tokenizer

    oa = client(server)
    for i, adapter in enumerate([None, *llama_adapters]):
        for prompt in PROMPTS[:2]:
            style = "base:adapter" if i % 2 else "name"
            out = oa.completions.create(
                model=model_of(adapter, style), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            ids, text = sdk_reference[(prompt, adapter)]
            assert out.choices[0].token_ids == ids, (adapter, prompt)
            assert out.choices[0].text == text, (adapter, prompt)
            assert out.choices[0].finish_reason == "length"
            assert out.usage.completion_tokens == len(ids) == MAX_TOKENS
    # token-id prompts give the same tokens as text prompts through the SDK
    ids, text = sdk_reference[(PROMPTS[2], "full8")]
    prompt_ids = Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).encode(PROMPTS[2]).ids
    tok_out = oa.completions.create(
        model="full8",
        prompt=prompt_ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert tok_out.choices[0].text == text


def test_streaming_completion_and_usage(server, sdk_reference):
    oa = client(server)
    stream = oa.completions.create(
        model="qv5", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == sdk_reference[(PROMPTS[1], "qv5")][1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(server, tiny_llama):
    from transformers import AutoTokenizer

    oa = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Stories begin when"}]
    whole = oa.chat.completions.create(
        model="mlp1", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    # the prompt is the model's chat template as transformers renders it (an independent reference)
    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert whole.usage.prompt_tokens == len(expected)
    streamed = oa.chat.completions.create(
        model="mlp1", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(server, sdk_reference):
    full = sdk_reference[(PROMPTS[0], None)][1]
    stop = full[2:4]
    assert stop and stop.strip(), "pick a prompt whose output has printable text"
    oa = client(server)
    out = oa.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_64_concurrent_streams(server, sdk_reference, llama_adapters):
    names = [None, *llama_adapters]
    keys = [(PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(64)]

    async def one(oa: openai.AsyncOpenAI, prompt: str, adapter: str | None) -> str:
        stream = await oa.completions.create(
            model=model_of(adapter), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0, timeout=120,
            http_client=httpx.AsyncClient(limits=limits, timeout=120),
        ) as oa:  # fmt: skip
            return await asyncio.gather(*(one(oa, p, a) for p, a in keys))

    for key, text in zip(keys, asyncio.run(main()), strict=True):
        assert text == sdk_reference[key][1], key


def test_errors_are_typed_and_name_the_problem(server):
    oa = client(server)
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        oa.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="nope"):
        oa.completions.create(model="tiny:nope", prompt="hi", max_tokens=2)
    for bad, field in [({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p")]:
        with pytest.raises(openai.BadRequestError, match=field) as info:
            oa.completions.create(model="tiny", prompt="hi", max_tokens=2, **bad)
        assert info.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match="echo with logprobs"):
        oa.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=2, echo=True)
    with pytest.raises(openai.BadRequestError, match="context"):
        oa.completions.create(model="tiny", prompt="word " * 2000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oa.completions.create(model="tiny", prompt="hi", max_tokens="many")  # type: ignore[arg-type]
    # none of that harmed serving
    assert oa.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


def test_disconnect_mid_stream_frees_pages_and_slot_refs(server):
    body = {"model": "full8", "prompt": "The river carried", "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    with httpx.Client(timeout=60) as h, h.stream("POST", f"{server.base_url}/completions", json=body) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 3:
                break  # leaving the block closes the connection mid-stream
    wait_for(lambda: server.metric("lorapipe_kv_pages_used", "scheduler") == 0, "KV pages to be freed")
    wait_for(lambda: server.metric("lorapipe_slot_refs", "scheduler") == 0, "slot references to drop")
    assert server.metric("lorapipe_running_requests", "scheduler") == 0


def test_load_and_unload_adapters_over_http(server, llama_adapters):
    base = server.base_url
    with httpx.Client(timeout=120) as h:
        r = h.post(
            f"{base}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(llama_adapters["rs12"])}
        )
        assert r.status_code == 200, r.text
        models = {m["id"]: m for m in h.get(f"{base}/models").json()["data"]}
        assert models["late"]["parent"] == "tiny" and models["tiny"]["parent"] is None
        assert all(models[a]["parent"] == "tiny" for a in llama_adapters)
        oa = client(server)
        assert oa.completions.create(model="late", prompt="hi", max_tokens=2).choices[0].finish_reason
        bad = h.post(f"{base}/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/nonexistent/x"})
        assert bad.status_code == 400 and "gone" in bad.json()["error"]["message"]
        r = h.post(f"{base}/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError, match="late"):
            oa.completions.create(model="late", prompt="hi", max_tokens=2)
        assert h.post(f"{base}/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404


def test_health_and_gateway_metrics_on_the_http_port(server):
    with httpx.Client(timeout=30) as h:
        assert h.get(f"http://127.0.0.1:{server.http_port}/health").status_code == 200
        text = h.get(f"http://127.0.0.1:{server.http_port}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("lorapipe_waiting_requests", "lorapipe_running_requests", "lorapipe_kv_cache_usage"):
        (sample,) = families[name].samples
        assert sample.labels == {"stage": "scheduler"}
    (usage,) = families["lorapipe_kv_cache_usage"].samples
    assert 0.0 <= usage.value <= 1.0
    (info,) = families["lorapipe_lora_requests_info"].samples
    assert {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= set(info.labels)
    assert info.labels["max_lora"] == "2" and info.value > 1e9  # a Unix time, as vLLM stamps it
    (resident,) = families["lorapipe_lora_resident_info"].samples
    assert {"resident_lora_adapters", "loading_lora_adapters", "max_lora"} <= set(resident.labels)
    # every stage's metrics are there, not only the tokenizer's
    stages = {s.labels["stage"] for s in families["lorapipe_stage_up"].samples if s.value == 1}
    assert stages >= {"tokenizer", "scheduler", "worker", "loader"}
