"""Per-request sampling parameters, shared by the offline engine and every stage that carries them."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (as vLLM does): dividing logits by less overflows float32."""
INT32_MAX = 2**31 - 1


MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY], as in OpenAI
REPETITION_RANGE = (0.01, 100.0)  # keeps a float32 logit finite once divided or multiplied by it
MAX_GUIDED_CHARS = 65536  # a JSON schema, regex or list of choices travels in every plan of its request
MAX_GUIDED_CHOICES = 256


class Guided(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Structured output: the request's output must match a grammar (runtime/common/grammar.py).
    `kind` json: `spec` is a JSON schema (its JSON text); json_object: any JSON object (`spec` empty);
    regex: `spec` is a regular expression the whole output matches; choice: `spec` is a JSON list of
    strings, the output exactly one of them."""

    kind: Literal["json", "json_object", "regex", "choice"]
    spec: str = ""

    def validate(self) -> None:
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GUIDED_CHARS:
            raise ValueError(f"guided.spec must be a string of at most {MAX_GUIDED_CHARS} characters")
        if self.kind == "choice":
            try:
                choices = msgspec.json.decode(self.spec, type=list[str])
            except msgspec.DecodeError:
                raise ValueError("guided choices must be a JSON list of strings") from None
            if not 1 <= len(choices) <= MAX_GUIDED_CHOICES or not all(choices):
                raise ValueError(
                    f"guided choices must be 1 to {MAX_GUIDED_CHOICES} non-empty strings, got {len(choices)}"
                )


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """temperature 0 (or below GREEDY_TEMPERATURE) means greedy; top_k 0 and top_p 1 disable those
    filters; an int seed makes the request's samples reproducible on their own; with None they come
    from a generator seeded by the engine's seed and the request id (independent of batch-mates too).
    The logits are adjusted before any of that, as vLLM does: `logit_bias` (token id -> added value),
    then `repetition_penalty` over prompt and output tokens (a positive logit divided by it, a negative
    one multiplied), then `frequency_penalty` × its count and `presence_penalty` once for each token
    already in the output, subtracted; `min_p` drops tokens less likely than min_p × the likeliest
    (after temperature). `guided` then leaves only the tokens its grammar allows. Their defaults change
    nothing."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    # with an int k: each output token's log-probability under the model's raw logits, and the k most
    # likely tokens' (None: none computed)
    logprobs: int | None = None
    guided: Guided | None = None  # structured output: the output follows this grammar
    # vLLM's prompt_logprobs = k: each prompt token's (after the first) log-probability under the raw
    # logits given the tokens before it, its rank and the k likeliest tokens'
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range (every range keeps the math finite)."""
        if not _int_in(self.max_tokens, 1, INT32_MAX):
            raise ValueError(
                f"max_tokens must be an integer in [1, {INT32_MAX}], got {_show(self.max_tokens)}"
            )
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {_show(self.temperature)}")
        if not _int_in(self.top_k, 0, INT32_MAX):
            raise ValueError(
                f"top_k must be an integer in [0, {INT32_MAX}] (0 disables it), got {_show(self.top_k)}"
            )
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {_show(self.top_p)}")
        if self.seed is not None and not _int_in(self.seed, 0, 2**63 - 1):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {_show(self.seed)}")
        if not isinstance(self.stop_token_ids, tuple | list) or len(self.stop_token_ids) > 1024:
            raise ValueError("stop_token_ids must be a list of at most 1024 token ids")
        for t in self.stop_token_ids:
            if not _int_in(t, 0, INT32_MAX):
                raise ValueError(f"stop_token_ids must be integers in [0, {INT32_MAX}], got {_show(t)}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {_show(self.ignore_eos)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {_show(v)}")
        lo, hi = REPETITION_RANGE
        if not _finite(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            raise ValueError(
                f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 disables it), "
                f"got {_show(self.repetition_penalty)}"
            )
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {_show(self.min_p)}")
        self._validate_logit_bias()
        if self.logprobs is not None and not _int_in(self.logprobs, 0, MAX_LOGPROBS):
            shown = _show(self.logprobs)
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {shown}")
        if self.prompt_logprobs is not None and not _int_in(self.prompt_logprobs, 0, MAX_LOGPROBS):
            shown = _show(self.prompt_logprobs)
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {shown}")
        if self.guided is not None:
            self.guided.validate()

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to values")
        for t, b in bias.items():
            if not _int_in(t, 0, INT32_MAX):
                raise ValueError(f"logit_bias keys must be token ids in [0, {INT32_MAX}], got {_show(t)}")
            if not _finite(b) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {_show(b)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes the logits before sampling (min_p is a sampling filter)."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _int_in(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
