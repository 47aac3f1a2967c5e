"""RMSNorm in one pass per row, optionally fused with the residual add before it: `rms_norm(x, w)` and
`add_rms_norm(h, d, w)` (h + d, then its norm; both returned). The rounding follows transformers' Llama
step by step, so the results equal the torch ops to within the order of one fp32 sum: the add rounds to
the model dtype, the norm runs in fp32 and rounds to the model dtype, and the weight multiplies that
rounded value and rounds again. Replaces the eight elementwise launches of the torch form (and their
fp32 round trips through memory) with one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.batch_info import next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    eps,
    stride_x,
    stride_d,
    stride_o,
    stride_s,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    # Grid: (rows,). One row of n_cols elements per program.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual, rounded as torch rounds it
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm expects rows [T, H] with contiguous rows, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(
            f"rms_norm weight {tuple(weight.shape)} {weight.dtype} does not match rows of "
            f"{x.shape[1]} {x.dtype}"
        )


def _launch(x, d, weight, out, total, eps: float, add: bool) -> None:
    if x.shape[0] == 0:
        return
    block = next_pow2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, d, weight, out, total, x.shape[1], eps,
        x.stride(0), d.stride(0), out.stride(0), total.stride(0),
        BLOCK=block, ADD=add, num_warps=min(8, max(1, block // 256)),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] → weight * norm(x), [T, H] in x's dtype (a new tensor)."""
    _check(x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, x, weight, out, out, eps, add=False)
    return out


def add_rms_norm(
    h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + d, weight * norm(h + d)), both [T, H] in h's dtype (new tensors; h and d are not written)."""
    _check(h, weight)
    if d.shape != h.shape or d.dtype != h.dtype or d.stride(-1) != 1:
        raise ValueError(
            f"add_rms_norm: the addend {tuple(d.shape)} {d.dtype} does not match {tuple(h.shape)} {h.dtype}"
        )
    total = torch.empty_like(h, memory_format=torch.contiguous_format)
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    _launch(h, d, weight, out, total, eps, add=True)
    return total, out
