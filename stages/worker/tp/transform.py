"""Tensor parallelism as a transformation of a built model (as gpt-fast does it): the model file does not
mention it. `tensor_parallel` gives a `LlamaModel` built on one rank's shard (`shard.py`) the split that
completes its partial results across ranks: the embedding rows a rank does not hold look up as zeros and
the ranks' lookups are summed; O's and down's outputs (each rank's input columns, their LoRA delta
included: A split by input rows, B whole, so the sum of the ranks' deltas is the whole delta) are
summed; the ranks' vocabulary columns of the logits are gathered. Two sums a layer, as Megatron."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.worker.model.llama import LlamaModel
from stages.worker.tp.group import TPGroup
from stages.worker.tp.shard import vocab_range


class SplitWeights:
    def __init__(self, group: TPGroup, vocab: int):
        self.group = group
        self.vocab = vocab
        self.first, self.rows = vocab_range(vocab, group.rank, group.size)

    def lookup(self, embed: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        h = embed[local.clamp(0, self.rows - 1)]
        h = h.masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(h)

    def sum_partial(self, out: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(out)

    def vocab_logits(self, last: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        logits = self.group.gather_columns(F.linear(last, lm_head).float())  # [B, size * rows]
        return logits if logits.shape[1] == self.vocab else logits[:, : self.vocab].contiguous()


def tensor_parallel(model: LlamaModel, group: TPGroup) -> LlamaModel:
    """Make `model` (built on rank `group.rank`'s shard) one rank of a tensor-parallel forward."""
    model.split = SplitWeights(group, model.cfg.vocab_size)
    return model
