"""The base model's linear layers: a plain weight tensor runs `F.linear`; an `Fp8Weight` (e4m3 codes and
one float32 scale per output row) runs an fp8 GEMM whose output is in the activations' dtype, which the
LoRA backend then adds its delta to, unquantized. Up to `kernels.fp8_gemm.MAX_M` tokens (decode) the
GEMM is weight-only (`kernels/fp8_gemm.py`: the activations unquantized, the codes widened in
registers), since those steps are bound by the weight bytes; more tokens quantize the input per token
(`kernels/fp8_quant.py`) and run `torch._scaled_mm` with row-wise scales (compute capability 8.9+,
bfloat16 output). Off CUDA the same products are taken in float32."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.fp8_gemm import MAX_M, w8a16_matmul, w8a16_matmul_ref
from kernels.fp8_quant import FP8, FP8_MAX, MIN_AMAX, quantize_per_token, quantize_per_token_ref
from runtime.common.quant_config import fp8_device_problem

Weight = torch.Tensor  # or Fp8Weight


@dataclass
class Fp8Weight:
    """W ≈ q * scale[:, None]."""

    q: torch.Tensor  # [N, K] float8_e4m3fn, rows contiguous
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """[N, K] in `dtype`: the exact products (float64) rounded once."""
        return (self.q.double() * self.scale.double()[:, None]).to(dtype)


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] → e4m3 codes with one scale per output row, its largest magnitude mapped to 448."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX  # [N]
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [N, K]
    return Fp8Weight(q.contiguous(), scale.contiguous())


def cat_weights(parts: list[Weight], quantize: bool) -> Weight:
    """The fused projection of `parts` stacked by output rows (q/k/v, gate/up). fp8 when every part is
    fp8, or when `quantize`; otherwise the fp8 parts are dequantized into the others' dtype."""
    fp8 = [p for p in parts if isinstance(p, Fp8Weight)]
    if len(parts) == 1 and (fp8 or not quantize):
        return parts[0]
    if not fp8 and not quantize:
        return torch.cat(parts, dim=0)
    if quantize or len(fp8) == len(parts):
        as_fp8 = [p if isinstance(p, Fp8Weight) else quantize_weight(p) for p in parts]
        return Fp8Weight(torch.cat([p.q for p in as_fp8]), torch.cat([p.scale for p in as_fp8]))
    dtype = next(p.dtype for p in parts if not isinstance(p, Fp8Weight))
    return torch.cat([p.dequantize(dtype) if isinstance(p, Fp8Weight) else p for p in parts], dim=0)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] → [T, N] in x's dtype."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias)
    return F.linear(x, w, bias)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_zeros((0, w.shape[0]))
    if x.shape[0] <= MAX_M:  # weight-only; the bias is added before the one rounding to x's dtype
        gemm = w8a16_matmul if x.is_cuda else w8a16_matmul_ref
        return gemm(x, w.q, w.scale, bias)
    if x.is_cuda:
        xq, xs = quantize_per_token(x)  # [T, K] e4m3, [T, 1]
        # row-wise scales: [T, 1] for the tokens, [1, N] for the output channels; W^T column-major
        out = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=x.dtype)
    else:
        xq, xs = quantize_per_token_ref(x)
        # e4m3 products are exact in float32, summed there and then scaled, as the fp8 GEMM does
        out = ((xq.float() @ w.q.float().t()) * xs * w.scale).to(x.dtype)  # [T, N]
    return out if bias is None else out + bias


def check_fp8_device(device: torch.device, dtype: torch.dtype, probe: bool = True) -> None:
    """Refuse a device and activation dtype the fp8 GEMM cannot run with. `probe`: also run one small
    fp8 GEMM on the device (which creates a CUDA context: the worker's, not the launcher's)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if problem := fp8_device_problem(capability, str(dtype).removeprefix("torch.")):
        raise ValueError(problem)
    if not probe:
        return
    try:  # row-wise scales are not on every architecture this torch build knows
        a = torch.zeros((16, 16), dtype=FP8, device=device)
        s = torch.ones((16, 1), dtype=torch.float32, device=device)
        torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError) as e:  # torch's checks raise either
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"this GPU's torch._scaled_mm takes no row-wise scales ({first})") from None
