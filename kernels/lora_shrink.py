"""Multi-LoRA shrink (SGMV): v[t, s, :r] = x[t] @ A_s[:r]^T for every token tile of one adapter, all
slices of a fused group in one launch, the K loop optionally split across programs. Split programs
write fp32 partials, which the expand sums, or (`ShrinkConfig.reduce`) the last of a tile's column block
to finish sums them, in split order, into one v (serial split-K, as CUTLASS's semaphore fix-up). The
adapter's A rows are found anywhere in a rank-row pool through its row of the row table. An 8-bit
(e4m3 or int8) pool's A rows are converted to x's dtype for the dot and each column of v scaled by its
row's scale (`kernels/lora_quant.py`); SCALED is a constexpr, so a pool in the model's dtype runs the
same code as without it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import device_info
from kernels.batch_info import META_COLS, BatchInfo, block_rank_for, interpreting, next_pow2, read_tiles
from kernels.lora_parts import shrink_columns, shrink_dot, tile_of
from kernels.lora_quant import check_scales

# Pipeline stages of the shrink's K loop (its x and A tiles in flight), where they fit (`fit_k_step`).
SHRINK_STAGES = 3


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    as_ptr,
    v_ptr,
    p_ptr,
    sem_ptr,
    ranks_ptr,
    rows_ptr,
    meta_ptr,
    K,
    k_per_split,
    table_width,
    stride_xt,
    stride_ar,
    stride_ai,
    stride_asr,
    stride_rs,
    stride_ri,
    stride_ts,
    stride_vp,
    stride_vt,
    stride_vi,
    stride_pp,
    NUM_SLICES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    META: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    # Grid: (tiles, column blocks of the flattened (slice, rank) space, K splits).
    # PDL: the expand after this may start now. It reads what this kernel writes only after its own wait.
    # This kernel reads the batch metadata and the row table before its wait (both are the step's
    # constant data), x and the pool's rows after it, and passes the wait before any return: its
    # completion then implies its predecessor's, for every kernel that waits on it.
    if PDL:
        gdc_launch_dependents()
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_t >= tl.load(meta_ptr):
        if PDL:
            gdc_wait()
        return
    start, end, slot = tile_of(meta_ptr, pid_t, META)
    sl, rk, in_group, prow, col_ok = shrink_columns(
        ranks_ptr, rows_ptr, slot, pid_n, table_width, stride_rs, stride_ri, stride_ts,
        NUM_SLICES, BLOCK_R, BLOCK_N,
    )  # fmt: skip
    if PDL:
        gdc_wait()
    if tl.max(col_ok.to(tl.int32), axis=0) == 0:
        return

    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    acc = shrink_dot(
        x_ptr, a_ptr, as_ptr, offs_m, m_ok, pid_k * k_per_split, K, k_per_split, sl, prow, col_ok,
        stride_xt, stride_ar, stride_ai, stride_asr, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, SCALED,
    )  # fmt: skip

    # Columns past the rank hold zeros (their A rows were masked): written too, so that the expand can
    # read whole 16-column groups with wide loads.
    offs_v = offs_m[:, None].to(tl.int64) * stride_vt + (sl * stride_vi + rk)[None, :]
    v_mask = m_ok[:, None] & in_group[None, :]
    if REDUCE_SPLITS <= 1:  # one partial per split (one v without a split)
        tl.store(v_ptr + pid_k * stride_vp + offs_v, acc, mask=v_mask)
    else:
        # Every split of this tile's column block stores its partial and counts itself in; the one that
        # counts last sums all partials in split order (the same sum whichever program it is) into v and
        # resets the counter for the next launch. The barrier puts every thread's store before the
        # count's release; the sum's loads skip L1, which does not see other SMs' stores.
        tl.store(p_ptr + pid_k * stride_pp + offs_v, acc, mask=v_mask)
        tl.debug_barrier()
        sem = sem_ptr + pid_t * tl.num_programs(1) + pid_n
        if tl.atomic_add(sem, 1, sem="acq_rel") == REDUCE_SPLITS - 1:
            total = tl.load(p_ptr + offs_v, mask=v_mask, other=0.0, cache_modifier=".cg")
            for p in tl.static_range(1, REDUCE_SPLITS):
                total += tl.load(p_ptr + p * stride_pp + offs_v, mask=v_mask, other=0.0, cache_modifier=".cg")
            tl.store(v_ptr + offs_v, total, mask=v_mask)
            tl.atomic_xchg(sem, 0, sem="relaxed")


@dataclass(frozen=True)
class ShrinkConfig:
    block_n: int  # columns of the flattened (slice, rank) space per program
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = SHRINK_STAGES
    reduce: bool = False  # the shrink sums its split-K partials itself: the expand reads one v
    # launched as a programmatic dependent when its caller asks (`lora_shrink(pdl=True)`); the heuristic
    # sets it from the device and the tile count (`device_info.pdl_for`), so that a variant's config
    # names it (the warm-up plans variants by their configs)
    pdl: bool = False

    @property
    def parts(self) -> int:
        """Partials the shrink leaves for the expand to sum (dim 0 of its output)."""
        return 1 if self.reduce else self.split_k


def shrink_config(
    info: BatchInfo, in_dim: int, num_slices: int, max_split: int = 16, *, operand_bytes: tuple[int, int]
) -> ShrinkConfig:
    """Heuristic block shape from host-known sizes (tuned on an H100, see docs/kernels.md): enough
    programs to fill the GPU, split-K when the batch has few tiles (decode), all slices of a small
    rank in one program so that x is read once. `operand_bytes`: the element sizes of x and of the
    pool's A rows, which bound the K step (`fit_k_step`)."""
    br, bm = info.block_rank, info.block_m
    cols = num_slices * br  # flattened (slice, rank) columns
    sms = device_info.num_sms(info.meta.device)
    tiles = max(1, info.num_tiles)
    block_k = 128
    split_cap = max(1, min(max_split, 256 // bm, in_dim // (2 * block_k)))
    # Rank tiles above 16 aim for four programs an SM, and sum their partials in the shrink. At one, a
    # decode step's shrinks over such adapters (a few 4-warp programs an SM, each streaming up to 64 rank
    # rows of A) wait on their loads; at two, 256-decode steps over 62 and 80 adapters of ranks 8-64
    # take 3-5 % less LoRA time on an H100 and 128 decodes over 40 of them 14 %; at four, a mixed step
    # over 80 such adapters (graphed at the bound's configs) another 5 %, decode steps 0-1 %. That needs
    # the shrink's own sum: with the expand re-summing the partials in every column block, a larger split
    # loses more than the shrink gains. Rank-16 tiles keep one program an SM and the expand's sum, whose
    # smallest steps the shrink's sum (an atomic and a second read on each kernel's critical path) makes
    # up to 8 % slower.
    wide = br > 16
    target = (4 if wide else 1) * sms
    if bm <= 16:
        block_n = min(64, next_pow2(cols))
        if tiles * triton.cdiv(cols, block_n) * split_cap < sms:
            block_n = 16  # tiny batches: more, narrower programs
    else:
        block_n = next_pow2(cols) if next_pow2(cols) <= 128 else br
    programs = tiles * triton.cdiv(cols, block_n)
    split = 1
    while split < split_cap and programs * split < target:
        split *= 2
    block_k, stages = fit_k_step(bm, block_n, block_k, operand_bytes, info.meta.device)
    return ShrinkConfig(
        block_n,
        block_k,
        split,
        num_warps=4,
        num_stages=stages,
        reduce=wide and split > 1,
        pdl=device_info.pdl_for(info.meta.device, info.num_tiles),
    )


def fit_k_step(
    block_m: int, block_n: int, block_k: int, operand_bytes: tuple[int, int], device: torch.device
) -> tuple[int, int]:
    """(K step, pipeline stages) for a shrink program of `block_m` x `block_n`: at most `block_k` and
    SHRINK_STAGES, the largest whose pipelined x and A tiles, stages * K step * (block_m * x bytes +
    block_n * A bytes), fit the shared memory one program may use (else the kernel compiles but the GPU
    refuses to load it): the K step halves first (down to the 16 of a dot), keeping the pipeline's
    depth, then the stages drop. bf16 tiles of up to 64 x 128 keep 128 and 3 on an H100."""
    x_bytes, a_bytes = operand_bytes
    limit = device_info.max_shared_memory(device)
    stages = SHRINK_STAGES

    def need(k: int, s: int) -> int:
        return s * k * (block_m * x_bytes + block_n * a_bytes)

    while block_k > 16 and need(block_k, stages) > limit:
        block_k //= 2
    while stages > 1 and need(block_k, stages) > limit:
        stages -= 1
    return block_k, stages


def split_counters(num_tokens: int, num_slices: int, block_rank: int, device) -> torch.Tensor:
    """Zeroed split counters for any reducing launch over at most `num_tokens` tokens of a group of
    `num_slices` slices: one per (tile, column block), with tiles at most one a token and column blocks
    at least 16 columns wide."""
    return torch.zeros(num_tokens * num_slices * block_rank // 16, dtype=torch.int32, device=device)


def check_row_table(rows: torch.Tensor, num_ids: int, info: BatchInfo) -> None:
    """The row table both kernels read: int32 [num_ids, width], rows contiguous, on the batch's device,
    wide enough for every rank the batch was planned for (its rank tile is that of a rank <= width)."""
    if rows.dtype != torch.int32 or rows.dim() != 2 or rows.shape[0] != num_ids:
        raise ValueError(f"rows must be int32 [{num_ids}, width], got {rows.dtype} {tuple(rows.shape)}")
    if rows.stride(1) != 1:
        raise ValueError("the row table must be contiguous in its last dim")
    if rows.device != info.meta.device:
        raise ValueError(f"the row table is on {rows.device}, the batch metadata on {info.meta.device}")
    if block_rank_for(rows.shape[1]) < info.block_rank:
        raise ValueError(
            f"the row table covers ranks up to {rows.shape[1]}, the batch has rank tile {info.block_rank}"
        )


def _check(x, a, ranks, rows, info: BatchInfo, cfg: ShrinkConfig, out, shape, a_scales=None) -> None:
    if x.dim() != 2 or a.dim() != 3 or ranks.dim() != 2:
        raise ValueError(
            f"expected x [T, K], a [P, N, K], ranks [I, N]; got {x.shape}, {a.shape}, {ranks.shape}"
        )
    T, K = x.shape
    _, num_slices, a_k = a.shape
    num_ids = ranks.shape[0]
    if a_k != K:
        raise ValueError(f"x has K={K} but A rows have {a_k} elements")
    if ranks.shape[1] != num_slices or ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be int32 [ids, {num_slices}], got {ranks.dtype} {tuple(ranks.shape)}")
    check_row_table(rows, num_ids, info)
    check_scales("A", a, a_scales, num_slices)
    a_dtype = x.dtype if a_scales is not None else a.dtype
    if x.dtype != a_dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x and A must share a float dtype (or A be e4m3), got {x.dtype} and {a.dtype}")
    if x.stride(1) != 1 or a.stride(2) != 1:
        raise ValueError("x rows and A rows must be contiguous in their last dim")
    if not (x.device == a.device == ranks.device == info.meta.device):
        raise ValueError("x, A, ranks and the batch metadata must be on one device")
    if T != info.num_tokens:
        raise ValueError(f"x has {T} tokens but the batch was prepared for {info.num_tokens}")
    br = info.block_rank
    if cfg.block_n > br and cfg.block_n % br:
        raise ValueError(f"block_n={cfg.block_n} must be a multiple of block_rank={br} when wider")
    if cfg.block_n < br and br % cfg.block_n:
        raise ValueError(f"block_rank={br} must be a multiple of block_n={cfg.block_n}")
    if out is not None and (
        tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous()
    ):
        raise ValueError(f"out must be contiguous float32 {shape}, got {out.dtype} {tuple(out.shape)}")


def _check_scratch(name: str, t: torch.Tensor, dtype: torch.dtype, need: int, device) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.numel() < need or t.device != device:
        raise ValueError(
            f"{name} must be contiguous {dtype} with at least {need} elements on {device}, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: torch.Tensor,
    rows: torch.Tensor,
    info: BatchInfo,
    *,
    out: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    config: ShrinkConfig | None = None,
    check: bool = True,
    pdl: bool = False,
    a_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K]; a [pool_rows, num_slices, K] (one layer's A rows of the rank-row pool, strided view,
    last dim contiguous); ranks [num_ids, num_slices] int32; rows [num_ids, width] int32, rows[id, k] =
    pool row of adapter id's rank row k (read only below the id's rank); all on the device. Returns fp32
    v [config.parts, T, num_slices, block_rank] (`out` if given) whose sum over dim 0 is x @ A^T per
    slice: the split-K partials, or their sum when the config reduces. Only rows of adapter tokens are
    written, in whole 16-column groups (zeros past each rank); everything else is left untouched.

    A reducing split also needs `partials` (fp32, at least split_k * T * num_slices * block_rank
    elements, any content) and `counters` (int32, at least one per (tile, column block) program of a
    split, all zero; every launch leaves them zero). Both are allocated when not given; a caller that
    launches often (or in CUDA graphs) keeps its own. `check=False` skips validating the arguments (the
    backend's hot path, whose views are built once). `pdl`: launch as a programmatic dependent where the
    config says so (`ShrinkConfig.pdl`); the caller promises that the kernel just before this one wrote
    neither the batch metadata nor the row table (this kernel reads them before its wait). `a_scales`:
    [pool_rows, num_slices] fp32, the scales of an e4m3 pool's A rows (`a` is then e4m3)."""
    T, K = x.shape
    num_slices = a.shape[1]
    br = info.block_rank
    cfg = config or shrink_config(info, K, num_slices, operand_bytes=(x.element_size(), a.element_size()))
    shape = (cfg.parts, T, num_slices, br)
    grid = (info.num_tiles, triton.cdiv(num_slices * br, cfg.block_n), cfg.split_k)
    if check:
        _check(x, a, ranks, rows, info, cfg, out, shape, a_scales)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)  # [parts, T, slices, block_rank]
    if info.num_tiles == 0:
        return out
    reduce = cfg.reduce and cfg.split_k > 1
    one = T * num_slices * br  # elements of one partial
    if reduce:
        if partials is None:
            partials = torch.empty(cfg.split_k * one, dtype=torch.float32, device=x.device)
        if counters is None:
            counters = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device)
        if check:
            _check_scratch("partials", partials, torch.float32, cfg.split_k * one, x.device)
            _check_scratch("counters", counters, torch.int32, grid[0] * grid[1], x.device)
    else:  # never dereferenced
        partials, counters = out, ranks
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    pdl = pdl and cfg.pdl
    _lora_shrink_kernel[grid](
        x,
        a,
        a if a_scales is None else a_scales,  # never dereferenced without scales
        out,
        partials,
        counters,
        ranks,
        rows,
        info.meta,
        K,
        k_per_split,
        rows.shape[1],
        x.stride(0),
        a.stride(0),
        a.stride(1),
        0 if a_scales is None else a_scales.stride(0),
        ranks.stride(0),
        ranks.stride(1),
        rows.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        one,
        NUM_SLICES=num_slices,
        BLOCK_R=br,
        BLOCK_M=info.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        REDUCE_SPLITS=cfg.split_k if reduce else 1,
        UPCAST=interpreting(),
        META=META_COLS,
        PDL=pdl,
        SCALED=a_scales is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    return out


def lora_shrink_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: torch.Tensor,
    rows: torch.Tensor,
    info: BatchInfo,
    a_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: v [T, num_slices, block_rank] float32, zero outside adapter tokens and real ranks."""
    T, num_slices = x.shape[0], a.shape[1]
    v = torch.zeros((T, num_slices, info.block_rank), dtype=torch.float32, device=x.device)
    host_ranks = ranks.cpu()
    for start, end, slot in read_tiles(info):
        for s in range(num_slices):
            r = min(int(host_ranks[slot, s]), info.block_rank, rows.shape[1])
            a_s = a[rows[slot, :r].long(), s].float()  # [r, K] gathered pool rows
            if a_scales is not None:
                a_s = a_s * a_scales[rows[slot, :r].long(), s, None]
            v[start:end, s, :r] = x[start:end].float() @ a_s.t()
    return v
