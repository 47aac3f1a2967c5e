"""The gated MLP's activation in one launch: gate_up [T, 2I] (gate, then up) → silu(gate) * up [T, I],
rounded as torch rounds `F.silu(gate) * up` in the model dtype (the activation, then the product).
Replaces two launches and the [T, I] intermediate between them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    # Grid: (rows, column blocks).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    src = x_ptr + row * stride_x
    gate = tl.load(src + cols, mask=ok, other=0.0)
    up = tl.load(src + n_cols + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] with contiguous rows → silu(gate) * up, [T, I] (a new tensor)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul expects [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _silu_mul_kernel[(T, triton.cdiv(inter, BLOCK))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return out
