"""Triton LoRA backend: the batch's token tiles are planned once per forward on the host and moved with
one non-blocking copy into a fixed device buffer; each `apply` is one shrink and one expand launch whose
grids come from host-known sizes, with ranks, scalings and adapter rows read on the device through
fixed tables (no host-device sync)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.batch_info import BatchInfo, BatchInfoBuilder, block_rank_for
from kernels.lora_expand import ExpandConfig, expand_config, lora_expand
from kernels.lora_shrink import ShrinkConfig, lora_shrink, shrink_config
from runtime.common.lora_layout import GroupLayout, LoraLayout
from stages.worker.lora.backend import LoraBackend
from stages.worker.lora.slots import LoraSlots

MAX_SPLIT_K = 16
PADDED_BLOCK_M = 16  # token tile of fixed-shape (graphed) decode batches


def workspace_rows(max_tokens: int) -> int:
    """Token rows of the shrink's fp32 partials buffer: room for split-K on decode-sized batches."""
    return max(2 * max_tokens, MAX_SPLIT_K * 256)


def split_cap(num_tokens: int, ws_rows: int) -> int:
    """Largest power-of-two split-K (at most MAX_SPLIT_K) whose partials fit `ws_rows` token rows."""
    cap = 1
    while cap < MAX_SPLIT_K and 2 * cap * max(1, num_tokens) <= ws_rows:
        cap *= 2
    return cap


def check_external(slots: LoraSlots, pool: torch.Tensor | None, rows: torch.Tensor) -> None:
    """A pool and row table fit the slots' layout, dtype, device and adapter ids (see the backend)."""
    layout, device = slots.layout, slots.mem.device  # the tensors' device: "cuda" names cuda:N there
    if pool is not None:
        want = (layout.num_layers, layout.row_elems)
        if pool.dim() != 3 or (pool.shape[0], pool.shape[2]) != want or pool.stride(2) != 1:
            raise ValueError(f"pool must be [{want[0]}, rows, {want[1]}] row-contiguous, got {pool.shape}")
        if pool.dtype != slots.dtype or pool.device != device:
            raise ValueError(
                f"pool is {pool.dtype} on {pool.device}, slots are {slots.dtype} on {device}"
            )
    ok_shape = rows.dim() == 2 and rows.shape[0] == slots.num_slots and rows.shape[1] >= layout.max_rank
    if rows.dtype != torch.int32 or not ok_shape or rows.stride(1) != 1 or rows.device != device:
        raise ValueError(
            f"rows must be int32 [{slots.num_slots}, >= {layout.max_rank}] row-contiguous on "
            f"{device}, got {rows.dtype} {tuple(rows.shape)} on {rows.device}"
        )


class TritonLoraBackend(LoraBackend):
    """The kernels read adapter weights as rank rows of a per-layer pool, through a row table: adapter
    id i (the slot number of the batch segments, and the row of `slots.ranks`/`slots.scalings`) has its
    rank row k of every layer at pool row `rows[i, k]`.

    Without `pool`/`rows` the pool is `slots.mem` itself (slot s's rank row k of layer l is row
    s*L*R + k of `LoraLayout.slot_rows(mem, l)`) and the backend owns that identity table.

    An externally owned rank-paged pool is passed as `pool` [num_layers, pool_rows, row_elems] (dtype of
    the slots, row_elems of the layout, last dim contiguous) with its `rows`: device int32
    [slots.num_slots, width], width >= layout.max_rank, contiguous rows. `rows` alone indexes the rows of
    `slots.mem` as above. The contract for the owner: both tensors are allocated once and never replaced
    (views and captured CUDA graphs hold their addresses), only updated in place in stream order before
    the forward that reads them; `rows[i, k]` must be a valid pool row for every k < the largest rank of
    id i in `slots.ranks` (entries past it may hold anything: they are loaded, never dereferenced); ranks
    must not exceed the table width (the kernels clamp them to it)."""

    name = "triton"

    def __init__(
        self,
        slots: LoraSlots,
        max_tokens: int,
        *,
        pool: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ):
        super().__init__(slots, max_tokens)
        self._init_rows(pool, rows)
        self._init_metadata()
        self._init_workspace()
        self._init_views()

    def _init_rows(self, pool: torch.Tensor | None, rows: torch.Tensor | None) -> None:
        if pool is not None and rows is None:
            raise ValueError("a rank-paged pool needs its row table")
        if rows is None:
            rows = self.layout.slot_row_table(self.slots.num_slots, self.slots.device)  # [S, max_rank]
        check_external(self.slots, pool, rows)
        self._pool, self._rows = pool, rows

    @property
    def rows(self) -> torch.Tensor:
        """The row table the kernels read (owned here unless passed in)."""
        return self._rows

    def _init_views(self) -> None:
        """Every (layer, group)'s A/B views and rank/scaling columns, made once: the pool and tables never
        move, and building views per call was a measurable share of a decode step's host time."""
        self._views = {}
        for layer in range(self.layout.num_layers):
            if self._pool is not None:
                base = self._pool[layer]  # [pool_rows, row_elems]
            else:
                base = LoraLayout.slot_rows(self.slots.mem, layer)  # [(S-1)*L*R + R, row_elems]
            for g in self.layout.groups:
                sl = slice(g.first_slice, g.first_slice + g.num_slices)
                self._views[layer, g.name] = (
                    LoraLayout.a_rows(base, g),  # [pool_rows, n, in_dim]
                    LoraLayout.b_rows(base, g),  # [pool_rows, out_total]
                    self.slots.ranks[:, layer, sl],  # [num_ids, n] int32
                    self.slots.scalings[:, layer, sl],  # [num_ids, n] fp32
                )

    def _init_metadata(self) -> None:
        self._builder = BatchInfoBuilder(self.max_tokens, self.slots.device)
        self._info: BatchInfo | None = None
        self._configs: dict[str, tuple[ShrinkConfig, ExpandConfig, torch.Tensor]] = {}
        self._padded_configs: dict[int, dict[str, tuple[ShrinkConfig, ExpandConfig, torch.Tensor]]] = {}

    def _init_workspace(self) -> None:
        # Shrink output (split-K fp32 partials), reused by every apply: allocated once, fixed address.
        self._ws_rows = workspace_rows(self.max_tokens)
        max_slices = max(g.num_slices for g in self.layout.groups)
        numel = self._ws_rows * max_slices * block_rank_for(self.layout.max_rank)
        self._workspace = torch.empty(numel, dtype=torch.float32, device=self.slots.device)  # [rows*N*R]

    @property
    def batch_info(self) -> BatchInfo | None:
        return self._info

    def prepare(self, seg_indptr: Sequence[int], seg_slots: Sequence[int], pad_to: int | None = None) -> None:
        """`pad_to`: a fixed-shape batch of that many tokens (the real ones first): the kernels' grids,
        split-K and rank tile then depend on `pad_to` alone, so one CUDA graph serves every batch of
        that size. The tile bound holds for runs of one token per sequence (decode)."""
        if pad_to is not None:
            self._prepare_padded(seg_indptr, seg_slots, pad_to)
            return
        used = sorted({s for s in seg_slots if s >= 0})
        max_rank = int(self.slots.host_ranks[used].max()) if used else 0
        info = self._builder.build(seg_indptr, seg_slots, max_rank)
        self._configs = self._make_configs(info)
        self._info = info

    def _prepare_padded(self, seg_indptr: Sequence[int], seg_slots: Sequence[int], pad_to: int) -> None:
        if seg_indptr[-1] > pad_to:
            raise ValueError(f"batch has {seg_indptr[-1]} tokens, more than pad_to={pad_to}")
        real = self._builder.build(seg_indptr, seg_slots, self.layout.max_rank, block_m=PADDED_BLOCK_M)
        # Tiles of runs cut at PADDED_BLOCK_M tokens: at most one partial tile per slot plus full ones.
        bound = min(pad_to, self.slots.num_slots + pad_to // PADDED_BLOCK_M)
        if real.num_tiles > bound:
            raise ValueError(f"{real.num_tiles} LoRA tiles exceed the padded bound {bound}")
        info = BatchInfo(
            meta=real.meta,
            num_tokens=pad_to,
            num_tiles=bound,  # grid size; programs past the device header's count return at once
            block_m=PADDED_BLOCK_M,
            max_len=pad_to,
            block_rank=real.block_rank,
            num_slots_used=real.num_slots_used,
        )
        cached = self._padded_configs.get(pad_to)
        if cached is None:
            cached = self._padded_configs[pad_to] = self._make_configs(info)
        self._configs, self._info = cached, info

    def _make_configs(self, info: BatchInfo) -> dict[str, tuple[ShrinkConfig, ExpandConfig, torch.Tensor]]:
        max_split = split_cap(info.num_tokens, self._ws_rows)
        configs = {}
        for g in self.layout.groups:
            shrink_cfg = shrink_config(info, g.in_dim, g.num_slices, max_split)
            shape = (shrink_cfg.split_k, info.num_tokens, g.num_slices, info.block_rank)
            v = self._workspace[: shape[0] * shape[1] * shape[2] * shape[3]].view(shape)  # shrink partials
            configs[g.name] = (shrink_cfg, expand_config(info, g.out_dims, shrink_cfg.split_k), v)
        return configs

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, group: GroupLayout) -> None:
        info = self._info
        if info is None:
            raise RuntimeError("TritonLoraBackend.apply called before prepare")
        if info.num_tiles == 0:
            return
        shrink_cfg, expand_cfg, v = self._configs[group.name]
        a, b, ranks, scalings = self._views[layer, group.name]
        # The views and configs were made here, once; the kernels' argument checks would cost a
        # measurable share of an eager step's host time (128 launches per forward of a 16-layer model).
        lora_shrink(x, a, ranks, self._rows, info, out=v, config=shrink_cfg, check=False)
        lora_expand(
            v,
            b,
            ranks,
            scalings,
            self._rows,
            out,
            group.out_offsets,
            group.out_dims,
            info,
            config=expand_cfg,
            check=False,
        )
