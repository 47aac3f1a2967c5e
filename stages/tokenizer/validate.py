"""Request validation at the pipeline's edge: sampling ranges, adapter name, prompt size (before any
tokenizing), prompt ids and length, with the error kinds and texts the client sees; and the request id
of a malformed message, so its error can name the request."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from tokenizers import Tokenizer

from proto.client import ErrorKind, GenerateRequest
from runtime.common.grammar import grammar_error
from runtime.common.names import adapter_name_problem


class Rejected(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message


def check_request(req: GenerateRequest, *, vocab_size: int, adapters: Mapping[str, str]) -> None:
    """The cheap checks, before tokenizing. `adapters` maps each known adapter name to
    "registered" or "unloading"."""
    s = req.sampling
    try:
        s.validate()
    except ValueError as exc:
        raise Rejected("invalid_request", str(exc)) from None
    if any(t >= vocab_size for t in s.stop_token_ids):
        raise Rejected("invalid_request", f"stop_token_ids must be < vocab size {vocab_size}")
    if s.logit_bias and any(t >= vocab_size for t in s.logit_bias):
        raise Rejected("invalid_request", f"logit_bias keys must be token ids < vocab size {vocab_size}")
    if s.guided is not None and (why := grammar_error(s.guided)) is not None:
        raise Rejected("invalid_request", f"guided: {why}"[:4000])
    if req.adapter is not None and (problem := adapter_name_problem(req.adapter)) is not None:
        raise Rejected("invalid_request", problem)
    state = adapters.get(req.adapter, "unknown") if req.adapter is not None else "registered"
    if state == "unloading":
        raise Rejected(
            "unknown_adapter", f"adapter {req.adapter!r} is being unloaded; it takes no new requests"
        )
    if state != "registered":
        raise Rejected("unknown_adapter", f"unknown adapter {req.adapter!r}; load it first")
    if (req.prompt is None) == (req.prompt_ids is None):
        raise Rejected("invalid_request", "give exactly one of prompt (text) or prompt_ids")


def check_prompt_size(req: GenerateRequest, *, max_prompt_bytes: int, max_model_len: int) -> None:
    """Refuse a prompt that cannot fit before paying for it: text by its UTF-8 size (a prompt of more
    than max_prompt_bytes bytes needs more tokens than the context holds), ids by their count."""
    room = max_model_len - req.sampling.max_tokens
    if req.prompt_ids is not None and len(req.prompt_ids) > room:
        raise Rejected(
            "invalid_request",
            f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens",
        )
    if req.prompt is not None and len(req.prompt) * 4 > max_prompt_bytes:  # else it surely fits
        nbytes = len(req.prompt) if len(req.prompt) > max_prompt_bytes else len(req.prompt.encode())
        if nbytes > max_prompt_bytes:
            raise Rejected(
                "invalid_request",
                f"prompt of {nbytes} bytes exceeds the server's limit of {max_prompt_bytes} bytes "
                f"(more tokens than the {max_model_len}-token context holds)",
            )


def prompt_byte_limit(tokenizer: Tokenizer, max_model_len: int, configured: int = 0) -> int:
    """`configured`, or the most UTF-8 bytes a prompt of max_model_len tokens can span: every token
    stands for at most as many bytes as its vocabulary entry has (an upper bound for byte-level BPE,
    whose entries spell each byte with one or two UTF-8 bytes)."""
    if configured > 0:
        return configured
    longest = max((len(t.encode()) for t in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 4)


def check_prompt(ids: list[int], req: GenerateRequest, *, max_model_len: int, vocab_size: int) -> None:
    """The prompt ids (given or tokenized) against the vocabulary and the model's context."""
    if req.prompt_ids is not None:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise Rejected(
                "invalid_request", f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})"
            )
    if not ids:
        raise Rejected("invalid_request", "the prompt is empty")
    if len(ids) + req.sampling.max_tokens > max_model_len:
        raise Rejected(
            "invalid_request",
            f"prompt ({len(ids)} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens",
        )


def encode_prompt(req: GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """Prompt ids: given ones as they are, text through the tokenizer (with its BOS template).
    encode_batch, unlike encode, releases the GIL, so a thread running it leaves the loop free."""
    if req.prompt_ids is not None:
        return req.prompt_ids.tolist()
    assert req.prompt is not None
    return tokenizer.encode_batch([req.prompt], add_special_tokens=True)[0].ids


def validate_generate(
    req: GenerateRequest,
    tokenizer: Tokenizer,
    *,
    max_model_len: int,
    vocab_size: int,
    adapters: Mapping[str, str],
) -> list[int]:
    """The request's prompt ids, or Rejected naming the first problem."""
    check_request(req, vocab_size=vocab_size, adapters=adapters)
    ids = encode_prompt(req, tokenizer)
    check_prompt(ids, req, max_model_len=max_model_len, vocab_size=vocab_size)
    return ids


def peek_request_id(body: bytes) -> str:
    """Best effort: the request_id of an undecodable message (field 1 of a tagged array), or ""."""
    try:
        raw = msgspec.msgpack.decode(body)
    except Exception:  # anything undecodable (invalid UTF-8 included): no id to echo
        return ""
    return raw[1][:200] if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[1], str) else ""
