"""The weight-only fp8 GEMM (`kernels/fp8_gemm.py`) against float64 products of the dequantized weights:
one token and several, widths that are no multiple of a block, K slices whose last one is short, bias
or none, both ways of widening the codes, and every e4m3 code value; the split-K counters are left at
zero; bad inputs are refused by name; the configs stay a small set that covers every token count. Runs
under the Triton interpreter on the CPU (`test_fp8_gemm_gpu.py`: the same on CUDA at the 8B shapes)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import (
    FP8,
    MAX_SPLIT,
    MIN_SPLIT_ITERS,
    TILE_MAX_M,
    GemmConfig,
    _counters,
    choose_config,
    configs_for,
    w8a16_matmul,
    w8a16_matmul_ref,
)
from kernels.fp8_quant import FP8_MAX


def _weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn((n, k), generator=gen, dtype=torch.float64) * 0.05
    scale = (w.abs().amax(dim=1) / FP8_MAX).float()  # [N]
    return (w / scale.double()[:, None]).to(FP8), scale  # [N, K] codes


def check_against_float64(out, x, q, scale, bias, ulp: float) -> None:
    """Every element within `ulp` of its float64 value (the output's one rounding) plus the float32
    accumulation's error, which is bounded by the sum of the products' magnitudes."""
    w64 = q.double() * scale.double()[:, None]  # [N, K], exact
    want = x.double() @ w64.t()
    if bias is not None:
        want = want + bias.double()
    magnitude = x.double().abs() @ w64.abs().t()
    err = (out.double() - want).abs()
    bound = ulp * want.abs() + 2e-6 * magnitude + 1e-30
    assert out.dtype == x.dtype and out.shape == want.shape
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3e}"


# (m, n, k, block_m, block_n, block_k, split): odd widths, K no multiple of the block, uneven slices
CASES = [
    (1, 40, 300, 16, 64, 128, 1),
    (1, 130, 520, 16, 64, 128, 3),
    (5, 97, 1024, 16, 32, 128, 4),
    (16, 64, 512, 16, 64, 256, 1),
    (33, 100, 700, 64, 64, 128, 2),
]


@pytest.mark.parametrize("bits", [True, False])
@pytest.mark.parametrize("m, n, k, bm, bn, bk, split", CASES)
def test_matches_float64_of_dequantized_weights(m, n, k, bm, bn, bk, split, bits):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    q, scale = _weights(n, k, gen)
    x = torch.randn((m, k), generator=gen).bfloat16()
    x[0, :3] *= 50  # an outlier feature: nothing is scaled per token, so nothing else moves
    bias = torch.randn(n, generator=gen).bfloat16() if m % 2 else None
    cfg = GemmConfig(bm, bn, bk, split, num_warps=4, num_stages=2, bits=bits)
    out = w8a16_matmul(x, q, scale, bias, config=cfg)
    # the interpreter rounds to bf16 by truncation: up to one ulp, 2^-7 of the value
    check_against_float64(out, x, q, scale, bias, ulp=2.0**-7)
    assert not any(c.any() for c in _counters.values())  # every fix-up reset its counter


def test_every_code_value_and_float16_inputs():
    """All 254 finite e4m3 codes (subnormals, both zeros, ±448) in one weight, each through a one-hot
    input: the output is the code times its row scale, exactly, in float16 and in bfloat16."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    codes = codes[~codes.float().isnan()]  # [254]
    n = codes.numel()
    q = codes.view(n, 1).expand(n, 16).contiguous()  # row i: code i in every column
    scale = torch.full((n,), 2.0**-4)
    for dtype in (torch.float16, torch.bfloat16):
        for bits in (True, False):
            x = torch.zeros((2, 16), dtype=dtype)
            x[0, 3] = 1.0
            x[1, 5] = -2.0
            out = w8a16_matmul(x, q, scale, config=GemmConfig(16, 64, 16, 1, 4, 1, bits))
            want = codes.double() * 2.0**-4  # [N]; exact in both dtypes
            assert torch.equal(out[0].double(), want.to(dtype).double())
            assert torch.equal(out[1].double(), (-2 * want).to(dtype).double())


def test_chosen_config_and_the_torch_reference():
    gen = torch.Generator().manual_seed(3)
    q, scale = _weights(200, 2048, gen)  # 4 SMs on the CPU: the chosen config splits K
    x = torch.randn((3, 2048), generator=gen).bfloat16()
    assert choose_config(3, 200, 2048, 4).split > 1
    out = w8a16_matmul(x, q, scale)
    check_against_float64(out, x, q, scale, None, ulp=2.0**-7)
    check_against_float64(w8a16_matmul_ref(x, q, scale), x, q, scale, None, ulp=2.0**-8)


def test_empty_and_rejected_inputs():
    q = torch.zeros((8, 32), dtype=FP8)
    s = torch.ones(8)
    assert w8a16_matmul(torch.zeros((0, 32)).bfloat16(), q, s).shape == (0, 8)
    with pytest.raises(ValueError, match="do not multiply"):
        w8a16_matmul(torch.zeros((2, 16)).bfloat16(), q, s)
    with pytest.raises(ValueError, match="dtypes"):
        w8a16_matmul(torch.zeros((2, 32)), q, s)  # float32 activations
    with pytest.raises(ValueError, match="contiguous"):
        w8a16_matmul(torch.zeros((32, 2)).bfloat16().t(), q, s)
    with pytest.raises(ValueError, match="bias"):
        w8a16_matmul(torch.zeros((2, 32)).bfloat16(), q, s, torch.zeros(9).bfloat16())
    with pytest.raises(ValueError, match="exceed the config's block_m"):
        w8a16_matmul(torch.zeros((17, 32)).bfloat16(), q, s, config=GemmConfig(16, 64, 16, 1, 4, 1))
    with pytest.raises(ValueError, match="a8 runs on CUDA only"):  # the interpreter's e4m3 rounding differs
        w8a16_matmul(torch.zeros((2, 32)).bfloat16(), q, s, config=GemmConfig(16, 64, 16, 1, 4, 1, a8=True))


SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


@pytest.mark.parametrize("sms", [4, 132])
def test_configs_cover_every_token_count_with_few_variants(sms):
    plan = configs_for(SHAPES_8B, sms, TILE_MAX_M)
    for n, k in SHAPES_8B:
        chosen = {choose_config(m, n, k, sms) for m in range(1, TILE_MAX_M + 1)}
        assert chosen <= set(plan) and len(chosen) <= 3  # one per token class
        for cfg in chosen:
            iters = -(-k // cfg.block_k)
            assert 1 <= cfg.split <= MAX_SPLIT
            assert cfg.split == 1 or iters // cfg.split >= MIN_SPLIT_ITERS
    for cfg, (m, _, _) in plan.items():
        assert m <= cfg.block_m
