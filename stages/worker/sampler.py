"""Turns each sequence's last-token logits into its next token under its own SamplingParams: greedy
rows by argmax in one op, sampled rows through temperature, top-k and top-p with a per-request
generator when the request has a seed (so its samples do not depend on its batch-mates)."""

from __future__ import annotations

import torch

from proto.sampling import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.default_gen = torch.Generator(device=device)
        self.default_gen.manual_seed(seed)
        self._gens: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._gens.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_gen
        gen = self._gens.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._gens[request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits: [B, V] float32. Returns one token id per row (one device→host read)."""
        if not request_ids:
            return []
        tokens = logits.argmax(dim=-1)  # [B]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        for i in sampled:
            p = params[i]
            probs = _filtered_probs(logits[i], p)
            tokens[i] = torch.multinomial(probs, 1, generator=self._generator(request_ids[i], p))[0]
        return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits → [V] probabilities after temperature, top-k and top-p (nucleus) filtering."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly before each token
        drop = before >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
