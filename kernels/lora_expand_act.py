"""The gate_up group's LoRA expand fused with the gated activation: act[t] = silu(g) * u, where g and u are
the base projection's gate and up halves plus the token's adapter delta (scaling * v @ B, as `lora_expand`
adds it), each rounded to the model dtype before the activation, as the unfused path rounds them. The
[T, 2I] projection is read once and the [T, I] activation written once; unfused, the expand reads and
writes the projection and the activation reads it again (7I elements a token against 3I).

Programs cover all T rows in blocks of ACT_BLOCK_M, not the adapter tiles, so base-only and padding rows
get their activation too. A block whose rows all have one adapter (inside prefill runs; the batch
metadata's column 3 names it, `BatchInfoBuilder`) adds its delta here, one dot per rank chunk. The rows
of every other block (decodes, run edges) get theirs from the plain expand first (`lora_expand(...,
skip_uniform=True)`), which skips the uniform blocks: a row of one adapter per program would make a
fused dot of 16 rows do the work of one, and a loop over a block's adapters serialises their loads (on
an H100, 256-decode steps 36-49 % slower).
`TritonLoraBackend.apply_act` runs the three kernels: shrink, expand of the mixed blocks, this. An e4m3
pool's B^T rows are dequantized as `lora_expand` does (v's columns times the rows' scales)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels.batch_info import ACT_BLOCK_M, META_COLS, BatchInfo, interpreting
from kernels.lora_expand import ExpandConfig, expand_config, lora_expand, lora_expand_ref, rank_chunk
from kernels.lora_parts import b_scale_chunk, split_sum
from kernels.lora_quant import check_scales
from kernels.lora_shrink import check_row_table


# T, the batch's token count, only bounds the rows: not specialised on (divisible by 16 or not), so that
# the kernel's variants are its configs' (`warmup_plan.py` plans those) whatever a batch's size.
@triton.jit(do_not_specialize=["T"])
def _lora_expand_act_kernel(
    gu_ptr,
    act_ptr,
    v_ptr,
    b_ptr,
    bs_ptr,
    ranks_ptr,
    scal_ptr,
    rows_ptr,
    meta_ptr,
    T,
    inter,
    table_width,
    stride_gt,
    stride_at,
    stride_vp,
    stride_vt,
    stride_vi,
    stride_br,
    stride_bsr,
    stride_rs,
    stride_ri,
    stride_ss,
    stride_si,
    stride_ts,
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    META: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    # Grid: (row blocks of BLOCK_M over all T rows, column blocks of the activation's I columns).
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The block's adapter id when all its rows have that one adapter (planned on the host into column 3
    # of the block's metadata row), else -1: then the plain expand has added the delta of its adapter
    # rows already (`lora_expand(..., skip_uniform=True)`), and only the activation is left.
    s = tl.load(meta_ptr + (pid_b + 1) * META + 3).to(tl.int64)
    # PDL: this kernel may start while the plain expand before it runs; it reads the projection and v,
    # which the kernels before it wrote, only after its wait (the metadata above is the step's own).
    if PDL:
        gdc_wait()
    offs_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    io_mask = m_ok[:, None] & n_ok[None, :]
    g_ptrs = gu_ptr + offs_m[:, None].to(tl.int64) * stride_gt + offs_n[None, :]
    gate = tl.load(g_ptrs, mask=io_mask, other=0.0)  # issued first: its latency hides behind the tiles
    up = tl.load(g_ptrs + inter, mask=io_mask, other=0.0)

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if s >= 0:  # one adapter for every row of the block: a dot per rank chunk
        cap = tl.minimum(BLOCK_R, table_width)  # a rank past the table would index the next id's rows
        rg = tl.minimum(tl.load(ranks_ptr + s * stride_rs), cap)
        ru = tl.minimum(tl.load(ranks_ptr + s * stride_rs + stride_ri), cap)
        # The shrink wrote v in whole 16-column groups (zeros past the rank); B rows past it are stale.
        rg16 = tl.cdiv(rg, 16) * 16
        ru16 = tl.cdiv(ru, 16) * 16
        offs_k = tl.arange(0, BLOCK_K)
        t_ptrs = rows_ptr + s * stride_ts + offs_k
        v_rows = v_ptr + offs_m[:, None].to(tl.int64) * stride_vt + offs_k[None, :]
        # Both halves' B loads are issued before either v: lora_expand's B chunk then v dot, once per
        # half, makes prefill steps 0.9-2.8 % slower.
        for k in range(0, tl.maximum(rg, ru), BLOCK_K):
            kk = k + offs_k
            prow = tl.load(t_ptrs + k, mask=kk < table_width, other=0).to(tl.int64)
            b_rows = b_ptr + (prow * stride_br)[:, None] + offs_n[None, :]
            bg = tl.load(b_rows, mask=(kk < rg)[:, None] & n_ok[None, :], other=0.0)
            bu = tl.load(b_rows + inter, mask=(kk < ru)[:, None] & n_ok[None, :], other=0.0)
            vg = split_sum(v_rows + k, m_ok[:, None] & (kk < rg16)[None, :], stride_vp, NUM_SPLITS, "")
            vu = split_sum(
                v_rows + stride_vi + k, m_ok[:, None] & (kk < ru16)[None, :], stride_vp, NUM_SPLITS, ""
            )
            if SCALED:  # e4m3 rows, as lora_expand: v's columns times the rows' scales, B in gate's dtype
                vg = vg * b_scale_chunk(bs_ptr, prow, k, rg, offs_k, stride_bsr, SCALED)[None, :]
                vu = vu * b_scale_chunk(bs_ptr + 1, prow, k, ru, offs_k, stride_bsr, SCALED)[None, :]
                bg, bu = bg.to(tl.float32).to(gate.dtype), bu.to(tl.float32).to(gate.dtype)
            vg = vg.to(bg.dtype)  # v rounded to the weight dtype, as the unfused expand feeds its dot
            vu = vu.to(bu.dtype)
            if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
                vg, bg, vu, bu = vg.to(tl.float32), bg.to(tl.float32), vu.to(tl.float32), bu.to(tl.float32)
            acc_g += tl.dot(vg, bg)
            acc_u += tl.dot(vu, bu)
        acc_g = acc_g * tl.load(scal_ptr + s * stride_ss)
        acc_u = acc_u * tl.load(scal_ptr + s * stride_ss + stride_si)

    # As the unfused path: the expand rounds g and u to the model dtype, then the activation rounds
    # silu(g), then the product (kernels/silu_mul.py).
    g = (gate.to(tl.float32) + acc_g).to(gate.dtype).to(tl.float32)
    u = (up.to(tl.float32) + acc_u).to(gate.dtype).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_at + offs_n[None, :]
    tl.store(a_ptrs, (a * u).to(gate.dtype), mask=io_mask)


@dataclass(frozen=True)
class ExpandActConfig:
    expand: ExpandConfig  # the plain expand of the rows outside one-adapter blocks
    act: ExpandConfig  # the fused kernel: activation columns a program, rank rows a dot, warps, stages

    @property
    def pdl(self) -> bool:
        """Both kernels' choice of dependent launch (`ExpandConfig.pdl`): the heuristic makes them one."""
        return self.act.pdl


def expand_act_config(info: BatchInfo, out_dims, split_k: int = 1) -> ExpandActConfig:
    """The plain expand's heuristic, and for the fused kernel 128 activation columns (256 of the
    projection) a program, the whole rank (up to 64) per dot unless many split-K partials would make
    the v tiles large; launched as a dependent where the plain expand is."""
    expand = expand_config(info, out_dims, split_k)
    act = ExpandConfig(
        block_n=128,
        block_k=rank_chunk(info.block_rank, ACT_BLOCK_M, split_k),
        num_warps=4,
        num_stages=2,
        pdl=expand.pdl,
    )
    return ExpandActConfig(expand=expand, act=act)


def fusable(out_offsets, out_dims) -> bool:
    """A group the fused kernel serves: two slices of equal width, gate then up, side by side."""
    return len(out_dims) == 2 and out_dims[0] == out_dims[1] and tuple(out_offsets) == (0, out_dims[0])


def _check(v, b, ranks, scalings, rows, gate_up, info: BatchInfo, cfg: ExpandConfig, b_scales=None) -> None:
    """The fused kernel's own arguments (`lora_expand` checks the rest)."""
    if v.dim() != 4 or v.shape[2] != 2 or v.dtype != torch.float32 or not v.is_contiguous():
        raise ValueError(f"v must be contiguous float32 [P, T, 2, R], got {v.dtype} {tuple(v.shape)}")
    T, two_i = gate_up.shape
    if gate_up.dim() != 2 or two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    if v.shape[1] != T or v.shape[3] != info.block_rank or T != info.num_tokens:
        raise ValueError(
            f"v {tuple(v.shape)} and gate_up {tuple(gate_up.shape)} do not match the batch "
            f"({info.num_tokens} tokens, rank tile {info.block_rank})"
        )
    if info.row_blocks * ACT_BLOCK_M < T:
        raise ValueError(
            f"the batch metadata plans {info.row_blocks} blocks of {ACT_BLOCK_M} rows, too few for {T}"
        )
    num_ids = ranks.shape[0]
    for name, t, dt in (("ranks", ranks, torch.int32), ("scalings", scalings, torch.float32)):
        if tuple(t.shape) != (num_ids, 2) or t.dtype != dt:
            raise ValueError(f"{name} must be {dt} [{num_ids}, 2], got {t.dtype} {tuple(t.shape)}")
    check_row_table(rows, num_ids, info)
    check_scales("B", b, b_scales, 2)
    b_dtype = gate_up.dtype if b_scales is not None else b.dtype
    if b.dim() != 2 or b_dtype != gate_up.dtype or b.stride(1) != 1 or b.shape[1] < two_i:
        raise ValueError(f"B rows must be [P, >= {two_i}] {gate_up.dtype}, got {b.dtype} {tuple(b.shape)}")
    if not (v.device == b.device == ranks.device == scalings.device == gate_up.device == info.meta.device):
        raise ValueError("v, B, ranks, scalings, gate_up and the batch metadata must be on one device")
    if cfg.block_k > info.block_rank or info.block_rank % cfg.block_k or cfg.block_k < 16:
        raise ValueError(f"block_k={cfg.block_k} must be >= 16 and divide block_rank={info.block_rank}")


def lora_expand_silu_mul(
    v: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    info: BatchInfo,
    *,
    config: ExpandActConfig | None = None,
    check: bool = True,
    pdl: bool = False,
    b_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """v [splits, T, 2, block_rank] fp32 partials of the gate_up group (from `lora_shrink`); b [pool_rows,
    >= 2I] its B^T rows (gate columns, then up); ranks/scalings [num_ids, 2]; rows the row table; gate_up
    [T, 2I] the base projection. Returns silu(gate + delta) * (up + delta), [T, I] (a new tensor), for
    every row (rows without an adapter: the plain activation). gate_up is changed: the rows outside
    one-adapter blocks get their delta. `check=False` skips validating the arguments (the backend's hot
    path). `pdl`: both kernels launch as programmatic dependents, as `lora_expand` says. `b_scales`:
    [pool_rows, 2] fp32, the scales of an e4m3 pool's B^T rows."""
    inter = gate_up.shape[1] // 2
    cfg = config or expand_act_config(info, (inter, inter), v.shape[0])
    if check:
        _check(v, b, ranks, scalings, rows, gate_up, info, cfg.act, b_scales)
    if info.num_tiles:
        lora_expand(
            v,
            b,
            ranks,
            scalings,
            rows,
            gate_up,
            (0, inter),
            (inter, inter),
            info,
            config=cfg.expand,
            check=check,
            skip_uniform=True,
            pdl=pdl,
            b_scales=b_scales,
        )
    return _act(v, b, ranks, scalings, rows, gate_up, info, cfg.act, pdl, b_scales)


def _act(
    v, b, ranks, scalings, rows, gate_up, info: BatchInfo, cfg: ExpandConfig, pdl: bool, b_scales
) -> torch.Tensor:
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    act = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return act
    grid = (triton.cdiv(T, ACT_BLOCK_M), triton.cdiv(inter, cfg.block_n))
    pdl = pdl and cfg.pdl
    _lora_expand_act_kernel[grid](
        gate_up,
        act,
        v,
        b,
        b if b_scales is None else b_scales,  # never dereferenced without scales
        ranks,
        scalings,
        rows,
        info.meta,
        T,
        inter,
        rows.shape[1],
        gate_up.stride(0),
        act.stride(0),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        b.stride(0),
        0 if b_scales is None else b_scales.stride(0),
        ranks.stride(0),
        ranks.stride(1),
        scalings.stride(0),
        scalings.stride(1),
        rows.stride(0),
        NUM_SPLITS=v.shape[0],
        BLOCK_R=info.block_rank,
        BLOCK_M=ACT_BLOCK_M,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UPCAST=interpreting(),
        META=META_COLS,
        PDL=pdl,
        SCALED=b_scales is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    return act


def lora_expand_silu_mul_ref(
    v: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    info: BatchInfo,
    b_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: the unfused expand's rounding (`lora_expand_ref`), then `silu_mul`'s."""
    inter = gate_up.shape[1] // 2
    out = lora_expand_ref(
        v, b, ranks, scalings, rows, gate_up.clone(), (0, inter), (inter, inter), info, b_scales
    )
    gate, up = out.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate).to(out.dtype).float()
    return (act * up).to(out.dtype)
