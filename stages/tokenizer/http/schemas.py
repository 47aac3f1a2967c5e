"""OpenAI API request and response bodies as msgspec Structs (HTTP JSON, not inter-process messages).
Request bodies declare only what lorapipe honours and forbid other fields: strict.py refuses an unknown
field, or a known one this server does not implement, by name."""

from __future__ import annotations

from typing import Any

import msgspec

from stages.tokenizer.http.logprobs import ChatLogprobs, CompletionLogprobs


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class StreamOptions(Body, kw_only=True):
    include_usage: bool = False


class _Sampling(Body, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extensions included)."""

    model: str
    n: int = 1
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or 0 disables it
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> value added to its logit
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None  # only equal to n (one sample per choice)
    user: str | None = None  # identifies the end user to OpenAI; changes nothing here
    return_token_ids: bool = False  # vLLM extension: each choice also carries its output token ids
    # structured output (http/structured.py): OpenAI's response_format, vLLM's guided_* and their newer
    # structured_outputs; at most one of them
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]  # text, token ids, or a batch of either (checked in prepare.py)
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None  # each output token's log-probability and this many likeliest tokens'
    prompt_logprobs: int | None = None  # vLLM extension: each prompt token's, and this many likeliest


class ChatMessage(Body, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # earlier turns of a conversation, passed to the chat template as they are
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # what a response message carries besides its content: accepted back when empty
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: what is left of the context after the prompt
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # vLLM extension
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: this many likeliest tokens' too
    # identifiers for OpenAI's caching and abuse monitoring; they change nothing here
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class LoadLoraRequest(Body, kw_only=True):
    """vLLM's body for POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(Body, kw_only=True):
    """vLLM's body for POST /v1/unload_lora_adapter (lora_int_id is accepted and ignored)."""

    lora_name: str
    lora_int_id: int | None = None


# --- responses ----------------------------------------------------------------------------------------


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(msgspec.Struct):
    """vLLM's entry of a choice's prompt_logprobs: one token's log-probability, rank and text."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # only with return_token_ids
    # only with prompt_logprobs: None for the first prompt token, then {token id: entry} per token
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class Message(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: Message
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: Message
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice] | list[ChatStreamChoice]
    usage: Usage | None = None
    object: str = "chat.completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    root: str
    parent: str | None = None
    max_model_len: int | None = None
    object: str = "model"
    owned_by: str = "lorapipe"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
