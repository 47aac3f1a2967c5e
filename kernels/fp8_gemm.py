"""Skinny-M fp8 GEMM, weight-only (w8a16): out [M, N] = x [M, K] @ (q [N, K] * scale [N, None])^T (+ bias),
x in bfloat16/float16 as it comes (no activation quantization), e4m3 weight codes widened to x's dtype in
registers, float32 accumulation, the row scale (and bias) applied once in float32 at the end.

Decode is bound by the weight bytes: the kernel's job is that every SM streams weights. A program owns
BLOCK_N output channels and a slice of K (split-K), so that a projection with few output blocks still
fills the GPU. The slices' float32 partial sums go to a workspace, and the last program of a column
block to arrive (an atomic counter per block) adds them up and writes the output, in the same launch;
it then resets its counter, so the counters are zero between launches (and CUDA-graph replays).
The MMA's row dimension is the output channels (acc [BLOCK_N, BLOCK_M]), so a batch of one to 16 tokens
pads only the narrow side. A variant (`GemmConfig.a8`) quantizes x in the kernel and multiplies e4m3 by
e4m3 instead; `benchmarks/bench_fp8_gemm.py` measures both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import device_info
from kernels.batch_info import interpreting
from kernels.fp8_quant import FP8, FP8_MAX, MIN_AMAX

# Largest token count serving gives the skinny kernel (linear.py); more take torch._scaled_mm. At 64 tokens
# _scaled_mm with its per-token quantization is the faster on the 8B shapes, at 16 this kernel
# (benchmarks/bench_fp8_gemm.py; docs/benchmarks.md).
MAX_M = 16
# Least K iterations (of BLOCK_K) one split-K slice takes: shorter slices spend more on the partials
# and the fix-up than they gain in parallelism.
MIN_SPLIT_ITERS = 4
MAX_SPLIT = 8
# Programs wanted in flight per SM: two keep loads outstanding while the other's MMAs and epilogue run.
PROGRAMS_PER_SM = 2
# How e4m3 codes are widened to bfloat16 (`_widen`): by bit moves rather than Triton's conversion.
BITS = True
# The alternative to widening the codes: each program quantizes its x tile to e4m3 per token and K block
# (finer than per token: no pass over the whole row first) and multiplies codes by codes on the fp8
# tensor cores, scaling each block's product by the tile's scales. No conversion of the weights, but the
# activations lose precision the weight-only product keeps.
A8 = False
# Column-block counters per device: N up to 2^16 column blocks.
COUNTERS = 1 << 16


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split: int  # K slices (1: no workspace, no fix-up)
    num_warps: int
    num_stages: int
    bits: bool = BITS  # widen the codes by bit moves (`_widen`) rather than Triton's conversion
    a8: bool = A8  # quantize x in the kernel and multiply in fp8 instead (w8a8; CUDA only)


# (block_m → block_n, block_k, warps, stages): the tile per token class. smem per stage is
# block_n * block_k fp8 + block_m * block_k * 2 bytes; the x tile is re-read from L2 once per column
# block, so block_n grows with block_m to keep that re-read below the weight bytes.
TILES = {
    16: (64, 256, 4, 4),
    32: (64, 256, 4, 3),
    64: (128, 128, 8, 3),
}
TILE_MAX_M = max(TILES)  # the most tokens the kernel takes (serving sends it up to MAX_M)


# M and the split count change per batch without changing the code: not specialised on (M = 1 or a
# multiple of 16 would otherwise each compile their own variant).
@triton.jit(do_not_specialize=["M", "split"])
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, k_per_split, split,
                  stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                  EVEN_K: tl.constexpr, BITS: tl.constexpr, A8: tl.constexpr, UPCAST: tl.constexpr,
                  FMAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    # Grid: (column blocks, K slices). acc [BLOCK_N, BLOCK_M] holds out^T of this block and slice.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # Rows past the ends read a valid row again (no load mask); their sums are never stored.
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)
    rm_in = tl.minimum(rm, M - 1).to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + (k_lo + rk)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rm_in[None, :] * stride_xm + (k_lo + rk)[:, None]  # [BLOCK_K, BLOCK_M]: x^T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs)
        else:
            k_ok = (k + rk) < k_hi
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
        if A8:  # x^T's columns quantized per K block to e4m3 (largest magnitude to FMAX), an fp8 MMA
            xf = xt.to(tl.float32)
            xs = tl.maximum(tl.max(tl.abs(xf), axis=0), MIN_AMAX) / FMAX  # [BLOCK_M]
            acc += tl.dot(w, (xf / xs[None, :]).to(w.dtype)) * xs[None, :]
        else:
            if UPCAST:  # the CPU interpreter multiplies 16-bit float bit patterns as integers
                xt = xt.to(tl.float32)
            acc = tl.dot(_widen(w, xt.dtype, BITS, UPCAST), xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    ok = (rn < N)[:, None] & (rm < M)[None, :]
    if SPLIT_K:
        mine = rm[None, :].to(tl.int64) * N + rn[:, None]  # [BLOCK_N, BLOCK_M] in a [M, N] slab
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + mine, acc, mask=ok)
        tl.debug_barrier()  # every thread's partials are written before the release below
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split - 1:  # the last slice of this column block: the others' partials are visible
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, split):  # its own slice too, as stored: the sum is the same in any block
                acc += tl.load(part_ptr + s * M * N + mine, mask=ok, other=0.0, cache_modifier=".cg")
            _epilogue(acc, rn, rm, ok, s_ptr, b_ptr, out_ptr, N, stride_om, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # zero for the next launch
    else:
        _epilogue(acc, rn, rm, ok, s_ptr, b_ptr, out_ptr, N, stride_om, HAS_BIAS)


# e4m3 → bfloat16 for two codes in one 16-bit register (`_widen`, pack=2, the pairs the MMA operand's
# layout holds): each code's byte goes to the high byte of a 16-bit half (prmt); its exponent and
# mantissa bits move down by 4 into bfloat16's fields with the sign left in place, which reads as the
# code's value times 2^-120 (the exponent biases differ by 120, and e4m3's subnormals land on bfloat16's);
# one fma by 2^120 (0x7B80; + -0) rescales exactly. The lower-numbered code is in the low half.
_E4M3_TO_BF16 = tl.constexpr("""{
.reg .b32 z, w, a, s, t, k, nz;
mov.b32 z, 0;
mov.b32 k, 0x7B807B80;
mov.b32 nz, 0x80008000;
cvt.u32.u16 w, $1;
prmt.b32 a, w, z, 0x1404;
and.b32 s, a, 0x80008000;
shr.b32 t, a, 4;
and.b32 t, t, 0x07F007F0;
or.b32 a, t, s;
fma.rn.bf16x2 $0, a, k, nz;
}""")


@triton.jit
def _widen(w, CDT: tl.constexpr, BITS: tl.constexpr, UPCAST: tl.constexpr):
    """e4m3 codes → CDT exactly (BITS reads the NaN code as 480; quantized weights hold none). BITS with
    bfloat16: by bit moves (`_E4M3_TO_BF16`: four integer operations and one fma per two codes, where
    Triton's conversion goes through float16 with a slow conversion per code); otherwise Triton's
    conversion. UPCAST (the CPU interpreter, which has no inline assembly): float32, BITS by the same
    bit moves in float32's fields, so that the interpreter checks their arithmetic."""
    u = w.to(tl.uint8, bitcast=True)
    if UPCAST:
        if BITS:
            u = u.to(tl.uint32)
            v = (((u & 0x80) << 24) | ((u & 0x7F) << 20)).to(tl.float32, bitcast=True) * 1.329227995784916e36
        else:
            v = w.to(tl.float32)
    elif BITS and CDT == tl.bfloat16:
        v = tl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,h", [u], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        v = w.to(CDT)
    return v


@triton.jit
def _epilogue(acc, rn, rm, ok, s_ptr, b_ptr, out_ptr, N, stride_om, HAS_BIAS: tl.constexpr):
    n_ok = rn < N
    out = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    dst = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=ok)


def block_m_for(m: int) -> int:
    """The token tile of a batch of m (1..TILE_MAX_M) tokens."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def split_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """K slices of a product with `n` output channels: as many as keep the programs within one wave of
    PROGRAMS_PER_SM an SM (equal programs that all run at once end together; a second wave of a few
    would stream at a fraction of the bandwidth), each slice at least MIN_SPLIT_ITERS iterations long."""
    want = PROGRAMS_PER_SM * sms // triton.cdiv(n, block_n)
    return max(1, min(want, triton.cdiv(k, block_k) // MIN_SPLIT_ITERS, MAX_SPLIT))


def choose_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """The tile and K split of an [m, k] x [n, k]^T product on a GPU of `sms` SMs."""
    bm = block_m_for(m)
    bn, bk, warps, stages = TILES[bm]
    return GemmConfig(bm, bn, bk, split_for(n, k, bn, bk, sms), warps, stages)


def configs_for(shapes, sms: int, max_m: int = MAX_M) -> dict[GemmConfig, tuple[int, int, int]]:
    """{config: (m, n, k) of a first product that takes it} over every m in 1..max_m and (n, k) in
    `shapes`: the variants serving can launch, for the warm-up."""
    out: dict[GemmConfig, tuple[int, int, int]] = {}
    for n, k in shapes:
        for m in range(1, max_m + 1):
            out.setdefault(choose_config(m, n, k, sms), (m, n, k))
    return out


_counters: dict[torch.device, torch.Tensor] = {}


def _counters_for(device: torch.device) -> torch.Tensor:
    """This device's column-block counters, zero between launches (each fix-up resets its own). The
    model's GEMMs run one after another on one stream, so one set per device is never shared by two
    launches at once."""
    if device not in _counters:
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def w8a16_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (bfloat16 or float16, rows contiguous), q [N, K] e4m3 (rows contiguous), scale [N] float32,
    bias [N] or None → [M, N] in x's dtype. `config`: a tile and split other than `choose_config`'s."""
    if x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"w8a16_matmul: x {tuple(x.shape)} and weight {tuple(q.shape)} do not multiply")
    if x.dtype not in (torch.bfloat16, torch.float16) or q.dtype != FP8 or scale.dtype != torch.float32:
        raise ValueError(f"w8a16_matmul: dtypes x {x.dtype}, weight {q.dtype}, scale {scale.dtype}")
    if x.stride(1) != 1 or q.stride(1) != 1 or scale.shape != (q.shape[0],) or scale.stride(0) != 1:
        raise ValueError("w8a16_matmul: x and weight need contiguous rows, scale one contiguous value a row")
    if bias is not None and (bias.shape != (q.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"w8a16_matmul: bias {tuple(bias.shape)} for {q.shape[0]} output channels")
    (M, K), N = x.shape, q.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)  # [M, N]
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    cfg = config or choose_config(M, N, K, device_info.num_sms(x.device))
    if M > cfg.block_m:
        raise ValueError(f"w8a16_matmul: {M} tokens exceed the config's block_m {cfg.block_m}")
    if cfg.a8 and interpreting():  # its float-to-e4m3 rounding is not the GPU's
        raise ValueError("w8a16_matmul: a8 runs on CUDA only, not under the Triton interpreter")
    k_per = triton.cdiv(triton.cdiv(K, cfg.split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per)  # slices that hold any K
    blocks = triton.cdiv(N, cfg.block_n)
    if split > 1 and blocks > COUNTERS:
        raise ValueError(f"w8a16_matmul: {blocks} column blocks exceed the {COUNTERS} counters")
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else out  # [S, M, N]
    cnt = _counters_for(x.device) if split > 1 else scale
    _w8a16_kernel[(blocks, split)](
        x, q, scale, bias if bias is not None else scale, out, part, cnt,
        M, N, K, k_per, split, x.stride(0), q.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split > 1, EVEN_K=K % cfg.block_k == 0, BITS=cfg.bits,
        A8=cfg.a8, UPCAST=interpreting(), FMAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def w8a16_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    """The same in plain torch: float32 products of x and the codes, scaled, rounded once to x's dtype."""
    out = (x.float() @ q.float().t()) * scale.float()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
