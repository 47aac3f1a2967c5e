"""How the forward meets the weights it does not hold. `WholeWeights` (the default) holds every weight:
the embedding lookup, the projections' outputs and the logits are complete where they are computed. A
tensor-parallel rank (`stages/worker/tp/`) replaces it with one that completes them across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class WholeWeights:
    def lookup(self, embed: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] of the tokens."""
        return embed[input_ids]

    def sum_partial(self, out: torch.Tensor) -> torch.Tensor:
        """The output [T, H] of a projection whose input features may be split (O and down, their LoRA
        delta included): already whole."""
        return out

    def vocab_logits(self, last: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, V] of the normed last hidden states [B, H]."""
        return F.linear(last, lm_head).float()


WHOLE = WholeWeights()
