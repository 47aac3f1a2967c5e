"""Strict request bodies: every top-level field a client sends is one this server honours, or the request
is refused with a 400 naming it. Fields of OpenAI's and vLLM's schemas that lorapipe knows but does not
implement pass only with a neutral value (what leaving them out means), so no request runs without
something it asked for."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

from stages.tokenizer.http.errors import ApiError

B = TypeVar("B")
Neutral = Callable[[Any], bool]
_AT = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _none(v: Any) -> bool:
    return v is None


def _zero(v: Any) -> bool:
    return v is None or (_number(v) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (_number(v) and v == 1)


def _false(v: Any) -> bool:
    return v is None or v is False


def _true(v: Any) -> bool:
    return v is None or v is True


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, list | dict | str) and not v)


def _no_tool(v: Any) -> bool:
    return v is None or v == "none"


def _text_only(v: Any) -> bool:
    return v is None or v == ["text"]


def _our_backend(v: Any) -> bool:
    return v is None or v in ("auto", "guidance", "llguidance")


def _default_tier(v: Any) -> bool:
    return v is None or v in ("auto", "default")


# Known to both routes, not implemented: sampling controls and vLLM's extensions.
COMMON_UNSUPPORTED: Mapping[str, Neutral] = {
    "min_tokens": _zero,  # vLLM
    "guided_grammar": _none,  # vLLM
    "guided_decoding_backend": _our_backend,  # vLLM: grammars run on llguidance here
    "guided_whitespace_pattern": _none,  # vLLM
    "use_beam_search": _false,  # vLLM
    "length_penalty": _one,  # vLLM
    "include_stop_str_in_output": _false,  # vLLM
    "skip_special_tokens": _true,  # vLLM: special tokens are always left out of the text
    "spaces_between_special_tokens": _true,  # vLLM
    "truncate_prompt_tokens": _none,  # vLLM
    "bad_words": _empty,  # vLLM
    "allowed_token_ids": _none,  # vLLM
    "priority": _zero,  # vLLM
}
COMPLETION_UNSUPPORTED: Mapping[str, Neutral] = {
    **COMMON_UNSUPPORTED,
    "suffix": _empty,
}
CHAT_UNSUPPORTED: Mapping[str, Neutral] = {
    **COMMON_UNSUPPORTED,
    "tools": _empty,
    "tool_choice": _no_tool,
    "parallel_tool_calls": _none,
    "functions": _empty,
    "function_call": _no_tool,
    "audio": _none,
    "modalities": _text_only,
    "prediction": _none,
    "web_search_options": _none,
    "reasoning_effort": _none,
    "verbosity": _none,
    "store": _false,
    "metadata": _empty,
    "service_tier": _default_tier,
    "moderation": _none,
    "prompt_cache_options": _none,
    "prompt_cache_retention": _none,
    "continue_final_message": _false,  # vLLM
    "chat_template": _none,  # vLLM
    "chat_template_kwargs": _empty,  # vLLM
    "documents": _none,  # vLLM
    "echo": _false,  # vLLM (chat)
    "prompt_logprobs": _none,  # vLLM (completions only here)
}


TOKENIZE_UNSUPPORTED: Mapping[str, Neutral] = {
    "continue_final_message": _false,  # vLLM
    "chat_template": _none,  # vLLM
    "chat_template_kwargs": _empty,  # vLLM
    "tools": _empty,  # vLLM
    "mm_processor_kwargs": _empty,  # vLLM
}


def unsupported_field(name: str) -> ApiError:
    return ApiError(400, f"{name} is not supported by this server", name, "unsupported_parameter")


def decode_strict(body: bytes, type_: type[B], unsupported: Mapping[str, Neutral] | None = None) -> B:
    """`body` as `type_` (see convert_strict)."""
    return convert_strict(json_object(body), type_, unsupported)


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the body must be a JSON object")
    return raw


def convert_strict(
    raw: dict[str, Any], type_: type[B], unsupported: Mapping[str, Neutral] | None = None
) -> B:
    """`raw` as `type_`, a Struct with forbid_unknown_fields: a field it does not declare is refused by
    name, as unknown or (a key of `unsupported` with a value its check does not call neutral) as not
    supported; neutral values of unsupported fields are dropped."""
    declared = type_.__struct_fields__  # type: ignore[attr-defined]
    for name in [k for k in raw if k not in declared]:
        neutral = (unsupported or {}).get(name)
        if neutral is None:
            raise ApiError(400, f"unknown field {_show(name)!r}", _show(name, 100), "unknown_parameter")
        if not neutral(raw.pop(name)):
            raise unsupported_field(name)
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: msgspec.ValidationError) -> ApiError:
    """A 400 naming the field (dotted path) that is wrong; an unknown nested field names its own path."""
    text = str(exc)
    at = _AT.search(text)
    path = at.group(1) if at else ""
    unknown = _UNKNOWN.search(text)
    if unknown is not None:
        name = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return ApiError(400, f"unknown field {_show(name)!r}", _show(name, 100), "unknown_parameter")
    return ApiError(400, f"invalid request: {text}", path.split(".")[0].split("[")[0] or None)


def _show(name: str, limit: int = 60) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."
