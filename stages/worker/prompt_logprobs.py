"""Prompt log-probabilities (vLLM's `prompt_logprobs` = k) for the requests that ask: each prompt token's
after the first, under the model's raw logits given the tokens before it, with its rank and the k likeliest
tokens'. A step that prefills such a request runs eagerly, its forward taking logits at those positions
besides each sequence's last (the hidden states are the prefill's own, nothing is recomputed); they are
reduced on the device and copied to the host in one batch, then handed to the request's first output.
A step in which nobody asks runs as before."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proto.client import TokenLogprobs
from stages.worker.runner import ModelRunner, SeqInput, whole_copy_waits
from stages.worker.step_state import WorkerRequest

Wants = dict[int, tuple[int, int]]  # scheduled index -> (first position in its chunk, count)


def prompt_wants(scheduled: Sequence[tuple[WorkerRequest, int]]) -> Wants:
    """The chunk positions whose logits predict a prompt token not reported yet, per request that asks
    (before the step's num_computed update; a recomputed prefill reports nothing twice)."""
    wants: Wants = {}
    for i, (req, n) in enumerate(scheduled):
        if req.sampling.prompt_logprobs is None:
            continue
        start = req.num_computed
        lo, hi = max(start, req.prompt_lp_done), min(start + n, req.prompt_len - 1)
        if hi > lo:
            wants[i] = (lo - start, hi - lo)
    return wants


@torch.inference_mode()
def forward_with_prompt_rows(
    runner: ModelRunner,
    seqs: list[SeqInput],
    layer_waits: list[list] | None,
    pending: torch.Tensor | None,
    wants: Wants,
) -> tuple[torch.Tensor, list[int] | None, torch.Tensor, dict[int, tuple[int, int]]]:
    """`ModelRunner.execute_grouped` run eagerly, with the wanted positions' logits too: (logits [B, V],
    order, extra [P, V], {i: (its first extra row, count)})."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)  # as execute_grouped groups them
    ordered = [seqs[i] for i in order]
    before = whole_copy_waits(layer_waits)
    if before is not None:
        stream = torch.cuda.current_stream(runner.device)
        for event in before:
            stream.wait_event(event)
        layer_waits = None
    extra: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    offset = 0
    for i in order:
        if i in wants:
            first, count = wants[i]
            spans[i] = (len(extra), count)
            extra.extend(range(offset + first, offset + first + count))
        offset += len(seqs[i].token_ids)
    out = runner._forward_eager(ordered, layer_waits, pending, extra)  # [B + P, V]
    b = len(seqs)
    same = all(i == pos for pos, i in enumerate(order))
    return out[:b], None if same else order, out[b:], spans


class PromptLogprobs:
    """One step's prompt log-probabilities: rows of `extra` [P, V] predict `targets` (the next prompt
    tokens); request i's are rows spans[i] = (first, count), with its top count ks[i]."""

    def __init__(
        self, extra: torch.Tensor, targets: list[int], spans: dict[int, tuple[int, int]], ks: dict[int, int]
    ):
        self.spans, self.ks = spans, ks
        dev = extra.device
        lp = torch.log_softmax(extra.float(), dim=-1)  # [P, V]
        index = torch.tensor(targets, dtype=torch.int64).to(dev, non_blocking=True).view(-1, 1)  # [P, 1]
        own = lp.gather(1, index)  # [P, 1]
        rank = (lp > own).sum(dim=1, keepdim=True).to(lp.dtype) + 1  # [P, 1]
        top = lp.topk(max(1, max(ks.values())), dim=-1)  # [P, K] each
        self.values = torch.cat((own, rank, top.values), dim=1)  # [P, 2 + K]
        self.ids = top.indices  # [P, K]
        self._event = None
        if dev.type == "cuda":
            values = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
            ids = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
            self.values, self.ids = values.copy_(self.values, True), ids.copy_(self.ids, True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(dev))

    def entries(self) -> dict[int, list[TokenLogprobs]]:
        """{scheduled index: its prompt tokens' log-probabilities}, once the host copies have landed."""
        if self._event is not None:
            self._event.synchronize()
        values, ids = self.values.tolist(), self.ids.tolist()
        out = {}
        for i, (first, count) in self.spans.items():
            k = self.ks[i]
            out[i] = [
                TokenLogprobs(logprob=v[0], top_ids=t[:k], top_logprobs=v[2 : 2 + k], rank=int(v[1]))
                for v, t in zip(values[first : first + count], ids[first : first + count], strict=True)
            ]
        return out


def issue(
    scheduled: Sequence[tuple[WorkerRequest, int]], wants: Wants, extra: torch.Tensor, spans
) -> PromptLogprobs:
    """The step's prompt log-probabilities, issued on the device (targets read from the prompts)."""
    targets: list[int] = []
    for i in sorted(spans, key=lambda i: spans[i][0]):
        req, _ = scheduled[i]
        first, count = wants[i]
        at = req.num_computed + first + 1  # the token each position's logits predict
        targets.extend(req.token_ids[at : at + count])
        req.prompt_lp_done = at + count - 1  # positions before it are reported (or the request fails)
    ks = {i: scheduled[i][0].sampling.prompt_logprobs for i in spans}
    return PromptLogprobs(extra, targets, spans, ks)
