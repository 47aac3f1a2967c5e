"""On a GPU, at real vocabulary sizes (an odd one near 115k, and Llama 3's 128,256): the fused top-k
log-probability kernel against a float64 log-softmax of the same logits, for a full decode batch of
256 rows and a few rows picked out of order, k = 1, 5 and 20, float32 and bf16 logits, with ties.
Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from kernels.top_logprobs import top_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    x[0, [vocab - 1, 70_000, 5, 64_000]] = 30.0  # a four-way tie at the top, spread over chunks
    x[1] = torch.randint(-4, 4, (vocab,), device="cuda", generator=g).float()  # ties everywhere
    x[2, ::2] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("vocab", [115_007, 128_256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("picked", [False, True])
def test_real_vocabularies_against_float64(vocab, dtype, k, picked):
    logits = _logits(256, vocab, dtype, seed=vocab + k)
    if picked:
        rows = torch.tensor([200, 2, 0, 1, 200], device="cuda")
    else:
        rows = torch.arange(256, device="cuda")
    tokens = torch.randint(0, vocab, rows.shape, device="cuda")
    out = top_logprobs(logits, rows, tokens, k)
    torch.cuda.synchronize()
    x = logits.double()[rows]  # [M, V]
    lsm = torch.log_softmax(x, dim=-1)
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]  # equal logits: lower id first
    assert torch.equal(out[:, 1 + k :].long(), ids)
    values = out[:, : 1 + k].view(torch.float32).double()
    torch.testing.assert_close(values[:, 0], lsm.gather(1, tokens.view(-1, 1))[:, 0], rtol=0, atol=5e-5)
    torch.testing.assert_close(values[:, 1:], lsm.gather(1, ids), rtol=0, atol=5e-5)


def test_one_row_and_many_splits_agree():
    """The same rows through one chunk per row and through the most chunks give the same bits."""
    logits = _logits(8, 128_256, torch.float32, seed=3)
    rows, tokens = torch.arange(8, device="cuda"), torch.zeros(8, dtype=torch.int64, device="cuda")
    one = top_logprobs(logits, rows, tokens, 20, splits=1)
    many = top_logprobs(logits, rows, tokens, 20, splits=64)
    assert torch.equal(one[:, 21:], many[:, 21:])
    torch.testing.assert_close(
        one[:, :21].view(torch.float32), many[:, :21].view(torch.float32), rtol=0, atol=1e-5
    )


def test_sampling_steps_compile_nothing_after_warm():
    """What the worker's warm-up launches (`warm`) is the only specialization sampling steps reach: rows
    that all ask or a few, picked in the forward's order or not, any k, logits rows of a larger buffer."""
    from kernels.host_copy import IndexUploads
    from kernels.top_logprobs import warm
    from proto.sampling import SamplingParams
    from stages.worker.compile_pool import counting_compiles
    from stages.worker.sampler import Sampler

    dev, vocab = torch.device("cuda"), 128_256
    warm(dev, vocab)
    buffer = torch.randn(300, vocab, device=dev)  # as the decode graphs' logits buffer
    uploads, sampler = IndexUploads(256, dev), Sampler(dev)
    names: list[str] = []
    with counting_compiles(names) as here:
        for n, asks, picked in [
            (1, [0], False),
            (7, [1, 4], True),
            (256, range(256), False),
            (33, [32], True),
        ]:
            logits = buffer[:n]
            params = [SamplingParams(logprobs=(i % 21) if i in asks else None) for i in range(n)]
            order = list(range(n))[::-1] if picked else None
            picks = (order, uploads(order)) if order is not None else None
            sampled = sampler.issue(logits, [f"r{i}" for i in range(n)], params, picks)
            assert sorted(sampled.logprobs()) == sorted(asks)
    torch.cuda.synchronize()
    assert not any(here), f"compiled after warm: {names}"
