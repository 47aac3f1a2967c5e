"""The grammar-mask kernel against an independent unpacking of the same words (numpy's little-endian
unpackbits of their bytes): rows picked in any order and twice, bit 31 of a word (a negative int32),
vocabularies that are not a multiple of 32 or of the kernel's block, words that cover fewer tokens than
the logits hold, all-allowed and none-allowed rows, and the logits left as they were (on the CPU under
the Triton interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE

from kernels.token_bitmask import masked_logits, reference


def expected(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> torch.Tensor:
    """float64 [n, V]: logits[rows[j], t] where bit t of row j's bytes (little-endian) is set."""
    x = logits.cpu().double()
    vocab = x.shape[1]
    bits = np.unpackbits(words.cpu().numpy().view(np.uint8), axis=1, bitorder="little")  # [n, 32 W]
    out = torch.full((len(rows), vocab), float("-inf"), dtype=torch.float64)
    for j, r in enumerate(rows):
        for t in np.flatnonzero(bits[j][:vocab]):
            out[j, t] = x[r, t]
    return out


def _words(g: torch.Generator, n: int, num_words: int) -> torch.Tensor:
    w = torch.randint(-(2**31), 2**31, (n, num_words), generator=g, dtype=torch.int64).to(torch.int32)
    w[0] = -1  # everything allowed
    if n > 1:
        w[1] = 0  # nothing allowed: the row is all -inf
    if n > 2:
        w[2, :] = 0
        w[2, -1] = -(2**31)  # only bit 31 of the last word: token 32 W - 1
    return w


@pytest.mark.parametrize("vocab,num_words", [(37, 2), (4_099, 129), (5_000, 100), (2_048, 64), (6_001, 188)])
def test_against_unpacked_bits(vocab, num_words):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 5).to(DEVICE)
    rows = [5, 0, 3, 3, 1]  # any order, a row twice
    words = _words(g, len(rows), num_words).to(DEVICE)
    before = logits.clone()
    got = masked_logits(logits, torch.tensor(rows, device=DEVICE), words)
    assert got.shape == (len(rows), vocab) and got.dtype == torch.float32
    want = expected(logits, rows, words)
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=0)
    torch.testing.assert_close(
        reference(logits, torch.tensor(rows, device=DEVICE), words).cpu().double(), want
    )
    assert torch.equal(logits, before)  # the forward's logits stay raw


def test_int32_rows_and_no_masks():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 100, generator=g).to(DEVICE)
    words = _words(g, 3, 4).to(DEVICE)
    rows = torch.tensor([2, 1, 0], dtype=torch.int32, device=DEVICE)
    want = expected(logits, [2, 1, 0], words)
    torch.testing.assert_close(masked_logits(logits, rows, words).cpu().double(), want, rtol=0, atol=0)
    empty = masked_logits(logits, rows[:0], words[:0])
    assert empty.shape == (0, 100)


def test_refuses_bad_operands():
    logits = torch.zeros(2, 64, device=DEVICE)
    words = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        masked_logits(logits.half(), rows, words)
    with pytest.raises(ValueError, match="int32 words"):
        masked_logits(logits, rows, words.long())
    with pytest.raises(ValueError, match="rows"):
        masked_logits(logits, rows[:1], words)
