"""The fused top-k log-probability kernel against a float64 log-softmax of the same logits: the sampled
token's log-probability, the k largest in order (equal logits: the lower token id first), on odd small
vocabularies split into one or several chunks, with ties, -inf logits and rows picked in any order, in
float32 and bf16 (on the CPU under the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from kernels.top_logprobs import top_logprobs


def expected(logits: torch.Tensor, rows: list[int], tokens: list[int], k: int):
    """(token log-probs [M], top ids [M, k], top log-probs [M, k]) in float64: the top k by a stable
    descending sort of the raw logits, so equal logits keep the lower id first."""
    x = logits.cpu().double()[rows]  # [M, V]
    lsm = torch.log_softmax(x, dim=-1)
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    return lsm.gather(1, torch.tensor(tokens).view(-1, 1))[:, 0], ids, lsm.gather(1, ids)


def check(logits: torch.Tensor, rows: list[int], tokens: list[int], k: int, splits: int | None = None):
    dev = logits.device
    out = top_logprobs(logits, torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev), k, splits)
    assert out.shape == (len(rows), 1 + 2 * k) and out.dtype == torch.int32
    out = out.cpu()
    values = out[:, : 1 + k].view(torch.float32).double()
    lp, ids, top = expected(logits, rows, tokens, k)
    assert out[:, 1 + k :].tolist() == ids.tolist()
    torch.testing.assert_close(values[:, 0], lp, rtol=0, atol=2e-5, equal_nan=True)
    torch.testing.assert_close(values[:, 1:], top, rtol=0, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("vocab,splits", [(37, 1), (1_001, None), (4_099, 1), (4_099, 3), (6_151, 2)])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_random_rows_against_float64(vocab, splits, k):
    g = torch.Generator().manual_seed(vocab + k)
    logits = (torch.randn(5, vocab, generator=g) * 4).to(DEVICE)
    rows = [3, 0, 4, 4]  # any order, a row twice (for two of its tokens)
    tokens = torch.randint(0, vocab, (4,), generator=g).tolist()
    check(logits, rows, tokens, k, splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_ties_and_infinite_logits(dtype, splits):
    """Equal logits rank the lower id first, across tiles and chunks; -inf logits weigh nothing (a token
    whose logit is -inf gets -inf), and rank last when fewer than k logits are finite."""
    vocab = 5_003
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, vocab, generator=g) * 3
    x[0, [4_900, 17, 2_500, 3]] = 20.0  # a tie at the top, ids spread over chunks and out of order
    x[1] = torch.randint(-3, 3, (vocab,), generator=g).float()  # many-way ties everywhere
    x[2, ::3] = float("-inf")
    x[3] = float("-inf")
    x[3, [4_000, 9, 2_222]] = torch.tensor([1.0, 1.0, -2.0])  # three finite logits: k = 5 takes two -infs
    x[4] = 0.5  # all equal: the top k are ids 0 .. k - 1
    x[5, 100] = -0.0  # -0.0 and 0.0 are the same logit
    x[5, 101] = 0.0
    x[5, :100] = -50.0
    logits = x.to(dtype).to(DEVICE)
    tokens = [3, 5, 3, 5, 7, 100]  # row 2's token 3 is -inf
    check(logits, list(range(6)), tokens, 5, splits)
    check(logits, list(range(6)), tokens, 20, splits)


def test_a_row_of_only_negative_infinity_is_not_a_number():
    """Every logit -inf: log-softmax is undefined (NaN, as torch gives); the ids are still 0 .. k - 1."""
    logits = torch.full((2, 300), float("-inf"), device=DEVICE)
    logits[1] = torch.arange(300, device=DEVICE, dtype=torch.float32)  # ascending: each tile raises the top
    check(logits, [0, 1], [0, 299], 3, 2)


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 10, device=DEVICE)
    rows, tokens = (
        torch.zeros(1, dtype=torch.int64, device=DEVICE),
        torch.zeros(1, dtype=torch.int64, device=DEVICE),
    )
    with pytest.raises(ValueError, match="k must be"):
        top_logprobs(logits, rows, tokens, 33)
    with pytest.raises(ValueError, match="k must be"):
        top_logprobs(logits, rows, tokens, 11)
    with pytest.raises(ValueError, match="differ"):
        top_logprobs(logits, rows, tokens[:0], 1)
    with pytest.raises(ValueError, match="contiguous"):
        top_logprobs(logits.t(), rows, tokens, 1)
