"""Per-request sampling parameters, shared by the offline engine and every stage that carries them."""

from __future__ import annotations

import math

import msgspec

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (as vLLM does): dividing logits by less overflows float32."""
INT32_MAX = 2**31 - 1


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """temperature 0 (or below GREEDY_TEMPERATURE) means greedy; top_k 0 and top_p 1 disable those
    filters; an int seed makes the request's samples reproducible on their own; with None they come
    from a generator seeded by the engine's seed and the request id (independent of batch-mates too)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _int_in(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
