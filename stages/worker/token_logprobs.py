"""Log-probabilities of sampled tokens, for the requests that ask (SamplingParams.logprobs = k): the
sampled token's and the k likeliest under the model's raw logits (before penalties and temperature,
as vLLM returns them), computed on the device in one batch per step (a handful of kernels whatever the
number of requests: no per-request indexing) and copied to the host with the tokens (no host sync of
their own)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proto.client import TokenLogprobs


class StepLogprobs:
    """One step's log-probabilities: `wanted` lists (request index k, its top count) for the requests
    that asked; values [M, 1 + K] float32 (the sampled token's, then the top K's) and ids [M, K] int64,
    K the largest top count among them; wanted[j]'s are row rows[j]."""

    def __init__(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        wanted: list[tuple[int, int]],
        rows: Sequence[int],
    ):
        """`logits` [M, V] on the device and `tokens` [M] int64, the token sampled from each row;
        wanted[j]'s row is rows[j]."""
        self.wanted, self.rows = wanted, rows
        # log p = logit - logsumexp(row): only the 1 + K values wanted are shifted, so no [M, V] of
        # log-probabilities is written and read again (the top K of the logits are those of log p)
        x = logits.float()  # [M, V]
        lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [M, 1]
        top = x.topk(max(n for _, n in wanted), dim=-1)  # [M, K] each
        self.values = torch.cat((x.gather(1, tokens.view(-1, 1)), top.values), dim=1) - lse  # [M, 1 + K]
        self.ids = top.indices  # [M, K]

    def to_host(self) -> None:
        """Issue the copies into pinned memory (the caller records the event that covers them)."""
        if self.values.is_cuda:
            values = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
            ids = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
            self.values, self.ids = values.copy_(self.values, True), ids.copy_(self.ids, True)

    def entries(self) -> dict[int, TokenLogprobs]:
        """{request index: its token's log-probabilities}, once the host copies have landed."""
        values, ids = self.values.tolist(), self.ids.tolist()
        top = self.ids.shape[1]
        out = {}
        for (k, n), r in zip(self.wanted, self.rows, strict=True):
            v, i = values[r], ids[r]
            out[k] = TokenLogprobs(logprob=v[0], top_ids=i if n == top else i[:n], top_logprobs=v[1 : 1 + n])
        return out
