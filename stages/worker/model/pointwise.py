"""The forward's pointwise work around the linear layers, chosen once by configuration
(`pointwise_backend`): RMSNorm (alone and fused with the residual add before it), the rotary embedding of
q and k with the K/V cache write, and the gated activation. "triton" runs each as one fused kernel
(`kernels/rms_norm.py`, `kernels/rotary.py`, `kernels/silu_mul.py`), the default on CUDA; "torch" is the
plain torch form of transformers' Llama, the CPU default and the reference. Both round in the same order
(see the kernels), so they differ only by the order of an fp32 sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.worker.model.kv_cache import KVCache

BACKENDS = ("triton", "torch")


def resolve_pointwise(name: str | None, device: torch.device) -> str:
    """`name`, or the device's default: the fused Triton kernels on CUDA, torch elsewhere."""
    if name is None:
        return "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown pointwise backend {name!r} (choose one of {', '.join(BACKENDS)})")
    return name


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32, scale in the model dtype: the order transformers uses.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] in x's dtype (half-split rotation, as in HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchPointwise:
    """transformers' Llama ops in plain torch."""

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def add_norm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float):
        """(h + d, norm(h + d))."""
        h = h + d
        return h, rms_norm(h, weight, eps)

    @staticmethod
    def rope_kv(qkv, cos, sin, rows, kv: KVCache, layer: int, num_heads: int, num_kv_heads: int):
        """qkv [T, (H + 2 KVH) * D]; writes rotated k and v at cache `rows` of `layer`; returns q
        [T, H, D]."""
        head_dim = kv.k.shape[-1]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = rotate(q.view(-1, num_heads, head_dim), cos, sin)
        k = rotate(k.view(-1, num_kv_heads, head_dim), cos, sin)
        kv.write(layer, rows, k, v.view(-1, num_kv_heads, head_dim))
        return q

    @staticmethod
    def act(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonPointwise:
    """The same ops, one fused Triton kernel each."""

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from kernels.rms_norm import rms_norm as kernel  # here: triton is only a dependency on Linux

        return kernel(x, weight, eps)

    @staticmethod
    def add_norm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float):
        from kernels.rms_norm import add_rms_norm

        return add_rms_norm(h, d, weight, eps)

    @staticmethod
    def rope_kv(qkv, cos, sin, rows, kv: KVCache, layer: int, num_heads: int, num_kv_heads: int):
        from kernels.rotary import rope_kv_write

        return rope_kv_write(qkv, cos, sin, rows, kv.k[layer], kv.v[layer], num_heads, num_kv_heads)

    @staticmethod
    def act(gate_up: torch.Tensor) -> torch.Tensor:
        from kernels.silu_mul import silu_mul

        return silu_mul(gate_up)


def pointwise_ops(backend: str) -> type[TorchPointwise] | type[TritonPointwise]:
    return TritonPointwise if backend == "triton" else TorchPointwise
