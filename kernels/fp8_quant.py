"""Dynamic per-token fp8 quantization of a linear layer's input in one launch: x [M, K] → q [M, K]
float8_e4m3fn and scale [M, 1] float32 with x ≈ q * scale, each row scaled so that its largest magnitude
maps to e4m3's largest finite value (448), so nothing is clipped. One program per row reads the row twice
(its maximum, then the quantized values), the second time from L2."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Least row maximum a scale is taken from: an all-zero row gets a finite scale and zero codes.
MIN_AMAX = 1e-12
# Columns a program holds at once: a whole row up to this width (the second pass then reads it from
# L1/L2), so a decode batch's few rows each take one load loop iteration per pass.
MAX_BLOCK = 16384


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, FMAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    # Grid: (rows,).
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride_x
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FMAX
    tl.store(s_ptr + row, scale)
    dst = q_ptr + row * stride_q
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
        tl.store(dst + cols, v.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32, bfloat16 or float16; contiguous rows) → (q [M, K] e4m3, scale [M, 1] float32)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_per_token expects [M, K] with contiguous rows, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_per_token expects a float input, got {x.dtype}")
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)  # [M, K]
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)  # [M, 1]
    if M:
        block = min(triton.next_power_of_2(max(K, 1)), MAX_BLOCK)
        warps = max(1, min(16, block // 512))  # 16 elements a thread
        consts = dict(FMAX=FP8_MAX, MIN_AMAX=MIN_AMAX, BLOCK=block)
        _quant_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), **consts, num_warps=warps)
    return q, scale


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain torch (the CPU path and the kernel's reference)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX  # [M, 1]
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [M, K]
    return q, scale
