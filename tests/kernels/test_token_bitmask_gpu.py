"""On a GPU, at real vocabulary sizes (an odd one near 115k, and Llama 3's 128,256 with the words of a
115k tokenizer, so the logits are wider than the masks): the grammar-mask kernel against numpy's
little-endian unpacking of the same words, for a full decode batch of 256 rows in order and a few rows
picked out of order. Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.token_bitmask import masked_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("vocab,num_words", [(115_007, 3_594), (128_256, 3_594), (128_256, 4_008)])
@pytest.mark.parametrize("picked", [False, True])
def test_real_vocabularies_against_unpacked_bits(vocab, num_words, picked):
    g = torch.Generator(device="cuda").manual_seed(vocab + num_words)
    logits = torch.randn(256, vocab, device="cuda", generator=g) * 4
    rows = torch.tensor([200, 2, 0, 1, 200], device="cuda") if picked else torch.arange(256, device="cuda")
    n = rows.shape[0]
    words = torch.randint(-(2**31), 2**31, (n, num_words), device="cuda", generator=g, dtype=torch.int64)
    words = words.to(torch.int32)
    words[0] = 0
    words[0, 7] = -(2**31)  # one token allowed, by bit 31: token 7 * 32 + 31
    before = logits.clone()
    got = masked_logits(logits, rows, words)
    torch.cuda.synchronize()
    bits = np.unpackbits(words.cpu().numpy().view(np.uint8), axis=1, bitorder="little")  # [n, 32 W]
    allowed = np.zeros((n, vocab), dtype=bool)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width].astype(bool)
    want = np.where(allowed, logits.cpu().numpy()[rows.cpu().numpy()], -np.inf)
    np.testing.assert_array_equal(got.cpu().numpy(), want)
    assert int(got[0].argmax()) == 7 * 32 + 31
    assert torch.equal(logits, before)
