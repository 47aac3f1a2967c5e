"""8-bit adapter rows for the GPU pool (`--lora-dtype fp8`: e4m3; `int8`: symmetric integers): each rank
row of a packed adapter block is quantized segment by segment (each slice's A row and each slice's B^T
row has its own fp32 scale, amax / qmax, qmax 448 for e4m3 and 127 for int8) and written into its pool
row, with its scales beside it; the shrink and expand kernels multiply by these scales. One program a
(layer, rank row, segment); the block is read from a device staging copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8, FP8_MAX
from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout

# --lora-dtype name -> the pool's row dtype, and the largest magnitude a segment's amax maps onto (e4m3's
# largest finite value; int8's symmetric range, rounded to nearest)
QUANT_DTYPES = {"fp8": FP8, "int8": torch.int8}
QMAX = {FP8: FP8_MAX, torch.int8: 127.0}
NUM_SCALES = 2 * NUM_SLICES  # per rank row and layer: each slice's A row, then each slice's B^T row


def segments(layout: LoraLayout) -> list[tuple[int, int]]:
    """(element offset, length) inside a rank row of the part each scale covers, in scale order: A of
    slice 0..6, then B^T of slice 0..6 (`TARGET_MODULES` order). Alignment padding is in none of them."""
    a, b = [], []
    for module in TARGET_MODULES:
        g, i = layout.module_slot(module)
        a.append((g.a_offset + i * g.in_stride, g.in_dim))
        b.append((g.b_offset + g.out_offsets[i], g.out_dims[i]))
    return a + b


def a_scales(scales: torch.Tensor, first_slice: int, num_slices: int) -> torch.Tensor:
    """[rows, num_slices] view of a group's A scales in one layer's scales [rows, NUM_SCALES]."""
    return scales[:, first_slice : first_slice + num_slices]


def b_scales(scales: torch.Tensor, first_slice: int, num_slices: int) -> torch.Tensor:
    """[rows, num_slices] view of a group's B^T scales in one layer's scales [rows, NUM_SCALES]."""
    return scales[:, NUM_SLICES + first_slice : NUM_SLICES + first_slice + num_slices]


def check_scales(name: str, w: torch.Tensor, scales: torch.Tensor | None, num_slices: int) -> None:
    """An 8-bit pool's rows come with fp32 scales [pool_rows, num_slices] (last dim contiguous); rows in
    a float dtype come without."""
    if (w.dtype in QMAX) != (scales is not None):
        raise ValueError(f"{name} scales are required exactly for e4m3 or int8 rows, got rows of {w.dtype}")
    if scales is not None and (
        scales.dtype != torch.float32
        or tuple(scales.shape) != (w.shape[0], num_slices)
        or scales.stride(1) != 1
        or scales.device != w.device
    ):
        raise ValueError(
            f"{name} scales must be float32 [{w.shape[0]}, {num_slices}] on {w.device} with contiguous "
            f"rows, got {scales.dtype} {tuple(scales.shape)} on {scales.device}"
        )


@triton.jit
def _quantize_rows_kernel(
    src_ptr,
    dst_ptr,
    scale_ptr,
    rows_ptr,
    seg_ptr,
    rank,
    stride_sl,
    stride_sk,
    stride_dl,
    stride_dr,
    stride_cl,
    stride_cr,
    BLOCK: tl.constexpr,
    QMAX_: tl.constexpr,
    INT: tl.constexpr,
):
    # Grid: (layers x rank rows, segments).
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    layer = (pid // rank).to(tl.int64)
    k = pid % rank
    row = tl.load(rows_ptr + k).to(tl.int64)  # the pool row of rank row k
    off = tl.load(seg_ptr + 2 * seg)
    n = tl.load(seg_ptr + 2 * seg + 1)
    src = src_ptr + layer * stride_sl + k * stride_sk + off
    dst = dst_ptr + layer * stride_dl + row * stride_dr + off
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        o = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(src + o, mask=o < n, other=0.0).to(tl.float32)))
    top = tl.max(amax, axis=0)
    # IEEE divisions (div_rn), as torch's: the scales and rows match `quantize_rows_ref` bit for bit
    scale = tl.where(top > 0, tl.div_rn(top, tl.full([], QMAX_, tl.float32)), 1.0)
    for start in range(0, n, BLOCK):
        o = start + tl.arange(0, BLOCK)
        y = tl.div_rn(tl.load(src + o, mask=o < n, other=0.0).to(tl.float32), scale)
        if INT:  # to nearest (halves away from -inf), inside the symmetric range
            y = tl.minimum(tl.maximum(tl.floor(y + 0.5), -QMAX_), QMAX_)
        tl.store(dst + o, y.to(dst_ptr.dtype.element_ty), mask=o < n)
    tl.store(scale_ptr + layer * stride_cl + row * stride_cr + seg, scale)


def _check(src, dst, scales, rows, segs) -> None:
    if src.dim() != 3 or dst.dim() != 3 or scales.dim() != 3:
        raise ValueError(
            f"expected src [L, r, E], dst [L, P, E], scales [L, P, S]; got {src.shape}, "
            f"{dst.shape}, {scales.shape}"
        )
    L, r, E = src.shape
    if dst.dtype not in QMAX or scales.dtype != torch.float32 or scales.shape[2] != NUM_SCALES:
        raise ValueError(
            f"dst must be e4m3 or int8 and scales float32 [.., {NUM_SCALES}], got {dst.dtype}, "
            f"{scales.dtype} {tuple(scales.shape)}"
        )
    if dst.shape[0] != L or scales.shape[0] != L or dst.shape[2] != E or scales.shape[1] != dst.shape[1]:
        raise ValueError(
            f"src {tuple(src.shape)}, dst {tuple(dst.shape)}, scales {tuple(scales.shape)} differ"
        )
    if rows.dtype != torch.int32 or rows.dim() != 1 or rows.numel() < r:
        raise ValueError(f"rows must be int32 [>= {r}], got {rows.dtype} {tuple(rows.shape)}")
    if segs.dtype != torch.int32 or tuple(segs.shape) != (NUM_SCALES, 2):
        raise ValueError(f"segs must be int32 [{NUM_SCALES}, 2], got {segs.dtype} {tuple(segs.shape)}")
    if src.stride(2) != 1 or dst.stride(2) != 1 or scales.stride(2) != 1:
        raise ValueError("src, dst and scales must be contiguous in their last dim")
    if not (src.device == dst.device == scales.device == rows.device == segs.device):
        raise ValueError("src, dst, scales, rows and segs must be on one device")


def quantize_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    segs: torch.Tensor,
    *,
    block: int = 1024,
    check: bool = True,
) -> None:
    """src [L, r, E] rank rows of a packed block (any float dtype); dst [L, P, E] e4m3 or int8 pool rows
    and scales [L, P, NUM_SCALES] fp32; rows [>= r] int32, rank row k goes to pool row rows[k]; segs
    [NUM_SCALES, 2] int32 (`segments`). Writes, for each segment of each rank row, q = x / s in dst's
    dtype (int8: rounded to nearest) and s = amax / QMAX (1 where the segment is all zero); elements
    outside the segments are left as they are."""
    if check:
        _check(src, dst, scales, rows, segs)
    L, r, _ = src.shape
    if L * r == 0:
        return
    _quantize_rows_kernel[(L * r, NUM_SCALES)](
        src,
        dst,
        scales,
        rows,
        segs,
        r,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        scales.stride(0),
        scales.stride(1),
        BLOCK=block,
        QMAX_=QMAX[dst.dtype],
        INT=dst.dtype == torch.int8,
    )


def quantize_rows_ref(
    src: torch.Tensor, segs: list[tuple[int, int]], dtype: torch.dtype = FP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: (q [L, r, E] in `dtype`, zero outside the segments; scales [L, r, NUM_SCALES] fp32)."""
    x, qmax = src.float(), QMAX[dtype]
    q = torch.zeros(x.shape, dtype=dtype, device=x.device)
    scales = torch.empty((*x.shape[:2], len(segs)), dtype=torch.float32, device=x.device)
    for j, (off, n) in enumerate(segs):
        part = x[..., off : off + n]
        top = part.abs().amax(-1)
        s = torch.where(top > 0, top / qmax, torch.ones_like(top))
        y = part / s[..., None]
        if dtype == torch.int8:
            y = torch.floor(y + 0.5).clamp(-qmax, qmax)
        q[..., off : off + n] = y.to(dtype)
        scales[..., j] = s
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, segs: list[tuple[int, int]]) -> torch.Tensor:
    """float32 rank rows from 8-bit rows and their scales (zero outside the segments)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for j, (off, n) in enumerate(segs):
        out[..., off : off + n] = q[..., off : off + n].float() * scales[..., j, None]
    return out
