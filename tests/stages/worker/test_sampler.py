"""The sampler's per-row finiteness check and greedy tokens, against numpy on the same logits: a row with a
NaN or an infinity anywhere fails alone, a row of huge but finite values does not, and every other row
gets its argmax (greedy) or a valid id (sampled)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from proto.sampling import SamplingParams
from stages.worker.sampler import NOT_FINITE, Sampler

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
VOCAB = 50_021  # odd, so no reduction splits it evenly


def _logits(device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, VOCAB, generator=g) * 4
    x[1, VOCAB - 1] = float("nan")  # last element: a reduction's tail
    x[2, 0] = float("inf")
    x[3, VOCAB // 2] = float("-inf")
    x[4] = torch.where(x[4] > 0, 3.0e38, -3.0e38)  # finite, near float32's limit
    x[4, 11] = 3.3e38  # the largest value, so its argmax is known
    x[5, 17] = float("nan")
    x[5, 18] = float("inf")
    x[6, :] = float("-inf")  # every value infinite
    return x.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled_rows", [(), (0, 3, 7)])
def test_rows_that_are_not_finite_fail_alone(device, sampled_rows):
    logits = _logits(device)
    ref = logits.cpu().double().numpy()
    finite = np.isfinite(ref).all(axis=1)
    assert finite.tolist() == [True, False, False, False, True, False, False, True]  # the premise
    params = [
        SamplingParams(temperature=0.8, top_k=50, seed=i) if i in sampled_rows else SamplingParams()
        for i in range(logits.shape[0])
    ]
    ids = [f"r{i}" for i in range(logits.shape[0])]
    tokens, failed = Sampler(torch.device(device)).sample(logits, ids, params)
    assert sorted(failed) == [i for i in range(len(ids)) if not finite[i]]
    assert all(why == NOT_FINITE for why in failed.values())
    for i, tok in enumerate(tokens):
        assert 0 <= tok < VOCAB
        if finite[i] and i not in sampled_rows:
            assert tok == int(np.argmax(ref[i]))
        if finite[i] and i in sampled_rows:  # top-k 50: among the row's 50 largest values
            assert ref[i, tok] >= np.sort(ref[i])[-50]


@pytest.mark.parametrize("device", DEVICES)
def test_each_request_is_sampled_from_the_row_it_names(device):
    """With `rows`, request k reads logits row rows[k], in any order; a row no request names (here the
    NaN rows 1 and 5, and row 2's infinity) fails nothing."""
    logits = _logits(device)
    ref = logits.cpu().double().numpy()
    rows = [7, 0, 4, 3]  # row 3 holds a -inf: its request fails
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=20, seed=3),
        SamplingParams(),
        SamplingParams(),
    ]
    picks = (rows, torch.tensor(rows, device=device))
    result = Sampler(torch.device(device)).issue(logits, ["a", "b", "c", "d"], params, picks)
    tokens, failed = result.result()
    assert sorted(failed) == [3]
    assert tokens[0] == int(np.argmax(ref[7])) and tokens[2] == int(np.argmax(ref[4]))
    assert ref[0, tokens[1]] >= np.sort(ref[0])[-20]


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_of_the_requests_that_ask_against_float64(device):
    """Request k reads row rows[k]: its sampled token's log-probability and its top k equal a float64
    log-softmax of that row (raw logits, penalties aside); requests that do not ask get none."""
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2)).to(device) * 3
    rows = [4, 0, 2]
    params = [
        SamplingParams(logprobs=3),
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1, logprobs=0, presence_penalty=1.0),
    ]
    picks = (rows, torch.tensor(rows, device=device))
    sampled = Sampler(torch.device(device)).issue(logits, ["a", "b", "c"], params, picks)
    tokens, _ = sampled.result()
    got = sampled.logprobs()
    assert sorted(got) == [0, 2]
    ref = torch.log_softmax(logits.cpu().double(), dim=-1)
    for k, n in [(0, 3), (2, 0)]:
        row = ref[rows[k]]
        assert abs(got[k].logprob - float(row[tokens[k]])) < 1e-5
        want = row.topk(n)
        assert got[k].top_ids == want.indices.tolist()
        assert np.allclose(got[k].top_logprobs, want.values.numpy(), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [None, [2, 0, 3, 1]])
def test_logprobs_when_every_row_asks_in_the_forwards_order(device, rows):
    """Every logits row asked for (computed in the logits' own order, the tokens put in that order):
    request k's entries are still those of row rows[k] and of its own token, whatever the order and
    whatever each request's top count."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5)).to(device) * 3
    counts = [3, 0, 5, 1]
    params = [SamplingParams(logprobs=n) for n in counts]
    params[1] = SamplingParams(temperature=0.9, seed=4, logprobs=0)  # a sampled token, not the argmax
    picks = None if rows is None else (rows, torch.tensor(rows, device=device))
    sampled = Sampler(torch.device(device)).issue(logits, list("abcd"), params, picks)
    tokens, _ = sampled.result()
    got = sampled.logprobs()
    ref = torch.log_softmax(logits.cpu().double(), dim=-1)
    for k, n in enumerate(counts):
        row = ref[k if rows is None else rows[k]]
        assert abs(got[k].logprob - float(row[tokens[k]])) < 1e-5
        want = row.topk(n)
        assert got[k].top_ids == want.indices.tolist()
        assert np.allclose(got[k].top_logprobs, want.values.numpy(), atol=1e-5)
