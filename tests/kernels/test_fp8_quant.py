"""The per-token fp8 quantization kernel and its torch reference against a float64 computation: each
row's scale is its largest magnitude over 448, and every code is the e4m3 value nearest x / scale; rows
with a gap between them, an all-zero row, no rows, widths that are no power of two or wider than one
block. The kernel's codes are checked on CUDA only: the Triton interpreter's float-to-e4m3 conversion
is off by a binade for some values (e.g. -31.1 → -16), so on the CPU only the kernel's scales are."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_quant import FP8, FP8_MAX, quantize_per_token, quantize_per_token_ref


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    x64 = x.cpu().double()
    amax = x64.abs().amax(dim=1, keepdim=True)
    want_scale = torch.where(amax > 0, amax / FP8_MAX, torch.full_like(amax, 1e-12 / FP8_MAX))
    assert torch.allclose(scale.cpu().double(), want_scale, rtol=1e-6, atol=0)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    codes = q.cpu().double()
    assert codes.abs().max() <= FP8_MAX
    target = x64 / scale.cpu().double()  # what each code stands for
    # an e4m3 step is 2^-3 of the value (3 mantissa bits), 2^-9 below the normal range
    step = torch.maximum(target.abs() * 2.0**-3, torch.full_like(target, 2.0**-9))
    assert ((codes - target).abs() <= 0.5 * step * (1 + 1e-6)).all()  # within half a step: the nearest code


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, width", [(5, 2500), (1, 64), (3, 1024), (0, 128), (3, 20000)])
def test_quantize_per_token(device, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * 31 + width)
    wide = torch.randn((rows, width + 5), generator=gen, dtype=torch.float64) * 4
    if rows > 2:
        wide[1] = 0  # an all-zero row: zero codes, a finite scale
        wide[2, 7] = 900.0  # an outlier sets its own row's scale only
    x = wide.to(dtype).to(device)[:, 2 : width + 2]  # rows width + 5 apart
    q, scale = quantize_per_token(x)
    assert q.shape == (rows, width) and q.is_contiguous()
    qr, sr = quantize_per_token_ref(x.cpu())
    if rows:
        _check(x, qr, sr)
        assert torch.allclose(scale.cpu(), sr, rtol=1e-6, atol=0)
        if rows > 2:
            assert (qr[1].float() == 0).all()
        if device.type == "cuda":
            _check(x, q, scale)
            assert (q.cpu().float() == qr.float()).float().mean() > 0.999  # a rare tie of the division


def test_refuses_what_it_cannot_quantize(device):
    with pytest.raises(ValueError, match="contiguous rows"):
        quantize_per_token(torch.zeros((4, 8), device=device).t())
    with pytest.raises(ValueError, match="float input"):
        quantize_per_token(torch.zeros((4, 8), dtype=torch.int32, device=device))
