"""Log-probabilities of sampled tokens, for the requests that ask (SamplingParams.logprobs = k): the
sampled token's and the k likeliest under the model's raw logits (before penalties and temperature,
as vLLM returns them), computed on the device in one batch per step and copied to the host with the
tokens (no host sync of their own). On CUDA one fused kernel pass reads each wanted row once
(kernels/top_logprobs.py; equal logits rank the lower token id first); elsewhere the same function in
torch (torch.topk's order among equal logits)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.top_logprobs import reference, top_logprobs
from proto.client import TokenLogprobs


class StepLogprobs:
    """One step's log-probabilities: `wanted` lists (request index k, its top count) for the requests
    that asked; `packed` [M, 1 + 2K] int32, row j wanted[j]'s: the sampled token's log-probability and
    the top K's as float32 bits, then the top K's ids, K the largest top count among them."""

    def __init__(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        wanted: Sequence[tuple[int, int]],
    ):
        """`logits` [N, V] on the device; `rows` [M] and `tokens` [M] int64 on it: wanted[j]'s logits row
        and the token sampled from it."""
        self.wanted = wanted
        top = max(n for _, n in wanted)
        compute = top_logprobs if logits.is_cuda else reference
        self.packed = compute(logits, rows, tokens, top)  # [M, 1 + 2 * top]

    def to_host(self) -> None:
        """Issue the copy into pinned memory (the caller records the event that covers it)."""
        if self.packed.is_cuda:
            host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            self.packed = host.copy_(self.packed, non_blocking=True)

    def entries(self) -> dict[int, TokenLogprobs]:
        """{request index: its token's log-probabilities}, once the host copy has landed."""
        packed = self.packed.numpy()  # numpy's tolist builds Python numbers faster than torch's
        top = (packed.shape[1] - 1) // 2
        values = packed[:, : 1 + top].view(np.float32)  # [M, 1 + top]
        logprobs, top_values = values[:, 0].tolist(), values[:, 1:].tolist()
        top_ids = packed[:, 1 + top :].tolist()  # [M][top]
        return {
            k: TokenLogprobs(
                logprob=lp, top_ids=i if n == top else i[:n], top_logprobs=v if n == top else v[:n]
            )
            for (k, n), lp, v, i in zip(self.wanted, logprobs, top_values, top_ids, strict=True)
        }
