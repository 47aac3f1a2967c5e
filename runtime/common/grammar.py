"""Structured output's grammars, with llguidance (chosen over xgrammar by benchmarks/bench_grammar.py,
docs/decisions.md): a `Guided` spec to the grammar text a matcher runs, its check (the tokenizer stage
refuses a bad schema or regex before the request runs) and the tokenizer a matcher masks over."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import llguidance

from proto.sampling import Guided

# JSON is generated compactly: with flexible whitespace a model may emit whitespace without end.
_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_of(guided: Guided) -> str:
    """The llguidance grammar of `guided` (not checked: see `grammar_error`)."""
    match guided.kind:
        case "json":
            return llguidance.LLMatcher.grammar_from_json_schema(guided.spec, overrides=_JSON_OPTIONS)
        case "json_object":
            schema = {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(guided.spec)
        case "choice":
            # Lark string literals take JSON's escapes, so any choice text is matched as it is
            choices = json.loads(guided.spec)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices)))
    raise ValueError(f"unknown guided kind {guided.kind!r}")


@functools.lru_cache(maxsize=256)  # the HTTP front end and the request check both ask
def grammar_error(guided: Guided) -> str | None:
    """Why `guided` cannot be matched (a malformed schema, an unsupported keyword, a bad regex), or None."""
    try:
        guided.validate()
        if guided.kind == "json":
            try:
                schema = json.loads(guided.spec)
            except ValueError as exc:
                return f"the JSON schema is not valid JSON: {exc}"
            if not isinstance(schema, dict):
                return "the JSON schema must be a JSON object"
        grammar = grammar_of(guided)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar) or None


def matcher_tokenizer(tokenizer_json: str, vocab: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The tokenizer masks are computed over: `tokenizer_json` is a tokenizers library tokenizer's JSON,
    `vocab` the width of the model's logits (ids past the tokenizer's are never allowed) and `eos_ids`
    the tokens a finished grammar allows. About a second for a 128k vocabulary: build it once. A tokenizer
    llguidance cannot hold (it panics, e.g. on a token of more than 1,024 bytes) raises ValueError, so
    that only the requests asking for structured output fail, by name."""
    return rust_call(llguidance.LLTokenizer, tokenizer_json, n_vocab=vocab, eos_token=list(eos_ids))


def rust_call(fn, *args, **kwargs):
    """`fn(...)` of llguidance, with a panic of its Rust code (pyo3's PanicException derives from
    BaseException, so `except Exception` would let it end the stage) raised as ValueError."""
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        if isinstance(exc, (Exception, KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise ValueError(f"llguidance failed: {exc}") from exc
