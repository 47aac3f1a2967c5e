"""Sampling under grammar masks applied by the mask kernel (kernels/token_bitmask.py) against a plain
torch computation on the same logits: greedy requests with a grammar alone (all of a batch in order, or
a few out of order, logits rows picked in the forward's order), one with a logit bias too (adjusted, then
masked), and a sampled one drawn from its masked distribution with its own seed; every token is one its
mask allows, and a request without a grammar keeps its plain argmax."""

from __future__ import annotations

import pytest
import torch

from kernels.token_bitmask import masked_logits
from proto.sampling import SamplingParams
from stages.worker.sampler import Allowed, Sampler

VOCAB = 3_001  # not a multiple of 32: the last word is partly past the vocabulary


def _words(g: torch.Generator, n: int) -> torch.Tensor:
    """[n, W] int32 masks allowing about one token in eight."""
    bits = torch.rand((n, ((VOCAB + 31) // 32) * 32), generator=g) < 0.125  # [n, 32 W]
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    words = (bits.view(n, -1, 32).long() * weights).sum(-1)  # [n, W] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _allowed(words: torch.Tensor) -> torch.Tensor:
    """[n, VOCAB] bool, unpacked independently of the kernel."""
    shifts = torch.arange(32, dtype=torch.int64)
    return (((words.long().unsqueeze(-1) % 2**32) >> shifts) & 1).view(words.shape[0], -1)[:, :VOCAB] == 1


@pytest.mark.parametrize("case", ["all_in_order", "some_out_of_order"])
def test_greedy_requests_take_their_masked_argmax(case):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=g) * 3  # [N, V]
    n = 6 if case == "all_in_order" else 3
    at = [4, 0, 5, 1, 3, 2]  # request k's logits row (the forward ran them in another order)
    guided = list(range(6)) if case == "all_in_order" else [5, 1, 3]  # requests with a grammar
    words = _words(g, n)
    rows = torch.tensor([at[k] for k in guided])
    allowed = Allowed(masked_logits(logits, rows, words), {k: j for j, k in enumerate(guided)}, {})
    params = [SamplingParams(max_tokens=4)] * 6
    picks = (at, torch.tensor(at))
    tokens, bad = (
        Sampler(torch.device("cpu"))
        .issue(logits, [f"r{k}" for k in range(6)], params, picks, None, allowed)
        .result()
    )
    assert bad == {}
    mask = _allowed(words)
    for k in range(6):
        row = logits[at[k]].clone()
        if k in guided:
            row[~mask[guided.index(k)]] = float("-inf")
            assert mask[guided.index(k), tokens[k]]
        assert tokens[k] == int(row.argmax()), k


def test_a_biased_and_a_sampled_request_under_masks():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=g) * 3
    words = _words(g, 3)
    mask = _allowed(words)
    favourite = int(torch.nonzero(mask[0])[-1])  # allowed: the bias makes it win
    banned = int(torch.nonzero(~mask[0])[0])  # not allowed: no bias lets it through
    params = [
        SamplingParams(max_tokens=4, logit_bias={favourite: 50.0, banned: 100.0}),
        SamplingParams(max_tokens=4, temperature=0.7, seed=123),
        SamplingParams(max_tokens=4),
    ]
    allowed = Allowed(masked_logits(logits, torch.arange(3), words), {0: 0, 1: 1, 2: 2}, {})
    tokens, bad = (
        Sampler(torch.device("cpu")).issue(logits, ["a", "b", "c"], params, None, None, allowed).result()
    )
    assert bad == {} and tokens[0] == favourite
    # the sampled one: softmax of its masked logits over the temperature, drawn as the sampler draws
    # (argmax of p / q, q ~ Exp(1) from the request's seeded generator)
    probs = torch.softmax(torch.where(mask[1], logits[1], float("-inf")) / 0.7, dim=-1)
    q = torch.empty_like(probs).exponential_(1, generator=torch.Generator().manual_seed(123))
    assert tokens[1] == int((probs / q).argmax()) and mask[1, tokens[1]]
    assert tokens[2] == int(torch.where(mask[2], logits[2], float("-inf")).argmax())
