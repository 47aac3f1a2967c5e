"""One request's logit adjustments before sampling, in vLLM's order: logit bias, then the repetition
penalty over prompt and output tokens, then the frequency and presence penalties over output tokens.
Its state (output token counts, the prompt's tokens, the bias) lives on the device and each sampled
token is counted there, so adjusting never waits for the host. Only requests that ask have one."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proto.sampling import SamplingParams


class LogitAdjuster:
    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab: int, device: torch.device):
        """`prompt`: the request's prompt ids (read once, here); `vocab`: the logits' width (ids at or
        past it, which validation refuses at the server's edge, are ignored rather than indexed)."""
        self.params = params
        p = params
        self.counts: torch.Tensor | None = None  # [V] int32: each token's count in the output so far
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            self.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
            self._one = torch.ones(1, dtype=torch.int32, device=device)  # [1]
        self.in_prompt: torch.Tensor | None = None  # [V] bool, for the repetition penalty only
        if p.repetition_penalty != 1.0:
            ids = torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.int64)
            in_prompt = torch.zeros(vocab, dtype=torch.bool)
            in_prompt[ids] = True
            self.in_prompt = _upload(in_prompt, device)
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # ([K] int64 ids, [K] float32 values)
        pairs = [(t, b) for t, b in (p.logit_bias or {}).items() if 0 <= t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
            values = torch.tensor([b for _, b in pairs], dtype=torch.float32)
            self.bias = (_upload(ids, device), _upload(values, device))

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """[V] float32 logits → a new [V] tensor, adjusted (the forward's logits are left as they are)."""
        p = self.params
        if self.bias is not None:
            row = row.index_add(0, self.bias[0], self.bias[1])
        if self.counts is None:
            return row
        if self.in_prompt is not None:
            seen = self.in_prompt | (self.counts > 0)
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = self.counts.to(row.dtype)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
        return row

    def record(self, token: torch.Tensor) -> None:
        """Count the sampled `token` (a 0-d int64 device tensor) in the output, on the device."""
        if self.counts is not None:
            self.counts.index_add_(0, token.view(1), self._one)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, from pinned memory: a copy from pageable memory would wait for the
    device's queued work first."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
