"""Turns each sequence's last-token logits into its next token under its own SamplingParams: greedy
rows by argmax in one op, sampled rows through temperature, top-k and top-p with a per-request
generator when the request has a seed (so its samples do not depend on its batch-mates). A row whose
logits are not finite is reported as failed instead of yielding a token."""

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

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> tuple[list[int], dict[int, str]]:
        """logits: [B, V] float32. Returns one token id per row and {row: why} for the rows that could
        not be sampled (logits or probabilities not finite): those fail alone, never their batch-mates.
        One device→host read, no sync before it (a bad row samples a stand-in distribution)."""
        if not request_ids:
            return [], {}
        ok = torch.isfinite(logits).all(dim=-1)  # [B]
        tokens = logits.argmax(dim=-1)  # [B]
        for i, p in enumerate(params):
            if p.greedy:
                continue
            probs = _filtered_probs(logits[i], p)
            good = ok[i] & torch.isfinite(probs).all() & (probs.sum() > 0)
            # multinomial on NaN or all-zero probabilities fails (a device assert on CUDA): never give it one
            probs = torch.where(good, probs, torch.ones_like(probs))
            tokens[i] = torch.multinomial(probs, 1, generator=self._generator(request_ids[i], p))[0]
            ok[i] = good
        host_tokens, host_ok = torch.stack((tokens, ok.to(tokens.dtype))).tolist()  # [2, B]
        errors = {
            i: "the model's output for this request is not finite (NaN or infinity): its adapter's "
            "weights or scalings are out of range, or its sampling values overflow"
            for i, good in enumerate(host_ok)
            if not good
        }
        return host_tokens, errors


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
