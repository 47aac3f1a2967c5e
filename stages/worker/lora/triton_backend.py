"""Triton LoRA backend: the batch's token tiles are planned once per forward on the host and moved with
one non-blocking copy into a fixed device buffer; each `apply` is one shrink and one expand launch whose
grids come from host-known sizes, with ranks, scalings and adapter rows read on the device through
fixed tables (no host-device sync)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from kernels.batch_info import BatchInfo, BatchInfoBuilder, block_rank_for
from kernels.lora_expand import ExpandConfig, expand_config, lora_expand
from kernels.lora_expand_act import ExpandActConfig, expand_act_config, fusable, lora_expand_silu_mul
from kernels.lora_quant import a_scales, b_scales
from kernels.lora_shrink import ShrinkConfig, lora_shrink, shrink_config, split_counters
from runtime.common.lora_layout import GroupLayout, LoraLayout
from stages.worker.lora.backend import PADDED_BLOCK_M, LoraBackend
from stages.worker.lora.pool import LoraPool

MAX_SPLIT_K = 16
# A padded (graphed) batch's kernel configs follow its tile count (the shrink's split-K and column block fill
# the GPU from it), which its graph cannot know. Configs chosen for the tile bound starve a step of few tiles:
# on an H100, 256 decodes over 8 or 32 adapters (21, 37 tiles) took 1.28 and 1.38 ms of LoRA kernels with the
# bound's configs, 0.83 and 1.04 ms with configs for 32 tiles; 80 adapters (82 tiles) 2.38 against 2.26 ms
# with configs for 128. So a padded size has a graph per class: configs for min(bound, c) tiles for each c
# here, and for the bound; a batch takes the first class c with tiles <= 1.5 c.
TILE_CLASSES = (32, 128)
# The gate_up group's expand is fused into the activation (kernels/lora_expand_act.py) for batches of more
# tokens than sequences (`max_seqs`, else this), which hold prefill runs: on an H100 it cuts a step's LoRA and
# activation time by 24 % at 31 x 256 prefill tokens and 8 % at 4 x 1,024, while 256-decode steps are 2-4 %
# slower with it.
FUSE_MIN_TOKENS = 256
# Per group: kernel configs (the gate_up group's expand config is an ExpandActConfig when it is fused with
# the activation), shrink output view.
Configs = tuple[ShrinkConfig, ExpandConfig | ExpandActConfig, torch.Tensor]


def workspace_rows(max_tokens: int) -> int:
    """Token rows of the shrink's fp32 partials buffer: room for split-K on decode-sized batches."""
    return max(2 * max_tokens, MAX_SPLIT_K * 256)


def split_cap(num_tokens: int, ws_rows: int) -> int:
    """Largest power-of-two split-K (at most MAX_SPLIT_K) whose partials fit `ws_rows` token rows."""
    cap = 1
    while cap < MAX_SPLIT_K and 2 * cap * max(1, num_tokens) <= ws_rows:
        cap *= 2
    return cap


def padded_tile_bound(pad_to: int, block_m: int, num_ids: int, max_seqs: int | None) -> int:
    """Most tiles of `block_m` tokens a padded batch of `pad_to` tokens can have. Runs are one per
    adapter id (the runner orders tokens by id) and one per sequence at most, and sum(ceil(len /
    block_m)) is at most the run count plus pad_to // block_m. Every program past a step's own tiles
    still launches and returns, so the bound is kept tight: with a large pool (762 ids in 4 GB at 1B
    shapes) the ids alone would make a 1,024-token graph launch 3x the programs that 256 sequences can
    need."""
    return min(pad_to, min(num_ids, max_seqs or pad_to) + pad_to // block_m)


def class_grid(tile_class: int, bound: int) -> int:
    """Tiles the grids of a padded batch's class cover: the bound for the bound's class, else 1.5 times
    the class (at most the bound). "auto" puts a batch in the first class whose grid holds its tiles: a
    decode step of few adapters on the bound's grid would launch 8x the programs it needs, and the empty
    ones cost a third of its LoRA time."""
    return bound if tile_class == bound else min(bound, tile_class * 3 // 2)


def classes_of(bound: int) -> tuple[int, ...]:
    """The tile classes of a padded batch whose tile bound is `bound`, ascending: the bound last."""
    return tuple(sorted({min(bound, c) for c in TILE_CLASSES} | {bound}))


class TritonLoraBackend(LoraBackend):
    """The kernels read adapter weights as rank rows of the pool's layer `l` (`pool.mem[l]`, [total_rows,
    row_elems]) through its row table: adapter id i (the id of the batch segments, and the row of
    `pool.ranks`/`pool.scalings`) has its rank row k at pool row `pool.rows[i, k]`. The pool allocates
    these tensors once and only updates them in place in stream order before the forward that reads
    them (views and captured CUDA graphs hold their addresses); `rows[i, k]` is a valid pool row for
    every k below id i's largest rank (entries past it are loaded, never dereferenced)."""

    name = "triton"

    def __init__(self, pool: LoraPool, max_tokens: int, max_seqs: int | None = None, fuse_act: bool = True):
        """`fuse_act`: the gate_up group's expand and the activation in one kernel (`apply_act`)."""
        super().__init__(pool, max_tokens, max_seqs)
        self.fuse_act = fuse_act
        self._init_metadata()
        self._init_workspace()
        self._init_views()

    @property
    def rows(self) -> torch.Tensor:
        """The row table the kernels read: int32 [num_ids, max_rank]."""
        return self.pool.rows

    def _init_views(self) -> None:
        """Every (layer, group)'s A/B views and rank/scaling columns, made once: the pool and tables never
        move, and building views per call was a measurable share of a decode step's host time."""
        self._views, self._scales = {}, {}
        for layer in range(self.layout.num_layers):
            base = self.pool.mem[layer]  # [total_rows, row_elems]
            for g in self.layout.groups:
                sl = slice(g.first_slice, g.first_slice + g.num_slices)
                self._views[layer, g.name] = (
                    LoraLayout.a_rows(base, g),  # [total_rows, n, in_dim]
                    LoraLayout.b_rows(base, g),  # [total_rows, out_total]
                    self.pool.ranks[:, layer, sl],  # [num_ids, n] int32
                    self.pool.scalings[:, layer, sl],  # [num_ids, n] fp32
                )
                scales = self.pool.scales  # e4m3 pools: [L, total_rows, NUM_SCALES] fp32
                self._scales[layer, g.name] = (
                    (None, None)
                    if scales is None
                    else (
                        a_scales(scales[layer], g.first_slice, g.num_slices),  # [total_rows, n]
                        b_scales(scales[layer], g.first_slice, g.num_slices),  # [total_rows, n]
                    )
                )

    def _init_metadata(self) -> None:
        self._builder = BatchInfoBuilder(self.max_tokens, self.pool.device)
        self._info: BatchInfo | None = None
        self._configs: dict[str, Configs] = {}
        # (pad_to, block_m, class, fuse_act) -> configs
        self._padded_configs: dict[tuple[int, int, int, bool], dict[str, Configs]] = {}

    def _init_workspace(self) -> None:
        # The shrink's split-K fp32 partials (its output when the expand sums them), its summed output
        # when it reduces them itself, and its split counters (zero between launches), reused by every
        # apply: allocated once, fixed addresses (captured graphs hold them).
        self._ws_rows = workspace_rows(self.max_tokens)
        max_slices = max(g.num_slices for g in self.layout.groups)
        br = block_rank_for(self.layout.max_rank)
        dev = self.pool.device
        self._workspace = torch.empty(self._ws_rows * max_slices * br, dtype=torch.float32, device=dev)
        self._v = torch.empty(self.max_tokens * max_slices * br, dtype=torch.float32, device=dev)
        self._counters = split_counters(self.max_tokens, max_slices, br, dev)

    @property
    def batch_info(self) -> BatchInfo | None:
        return self._info

    def prepare(
        self,
        seg_indptr: Sequence[int],
        seg_slots: Sequence[int],
        pad_to: int | None = None,
        block_m: int | None = None,
        tile_class: int | str | None = None,
    ) -> None:
        """`pad_to`: a fixed-shape batch of that many tokens (the real ones first): the kernels' grids,
        split-K and rank tile then depend on (`pad_to`, `block_m`, tile class) alone, so one CUDA graph
        serves every batch of that size and class. Tiles of at most `block_m` tokens (PADDED_BLOCK_M
        unless given) number at most one partial tile per adapter run plus pad_to // block_m full ones,
        whatever the runs: the bound's class has grids covering that bound, a smaller class c grids of
        1.5 c tiles (what "auto" puts in it; a batch with more is refused)."""
        if pad_to is not None:
            self._prepare_padded(seg_indptr, seg_slots, pad_to, block_m or PADDED_BLOCK_M, tile_class)
            return
        used = sorted({s for s in seg_slots if s >= 0})
        max_rank = int(self.pool.host_ranks[used].max()) if used else 0
        info = self._builder.build(seg_indptr, seg_slots, max_rank)
        self._configs = self._make_configs(info)
        self._info = info

    def tile_classes(self, pad_to: int, block_m: int | None = None) -> tuple[int, ...]:
        return classes_of(
            padded_tile_bound(pad_to, block_m or PADDED_BLOCK_M, self.pool.num_ids, self.max_seqs)
        )

    def _prepare_padded(
        self,
        seg_indptr: Sequence[int],
        seg_slots: Sequence[int],
        pad_to: int,
        block_m: int,
        tile_class: int | str | None,
    ) -> None:
        if seg_indptr[-1] > pad_to:
            raise ValueError(f"batch has {seg_indptr[-1]} tokens, more than pad_to={pad_to}")
        real = self._builder.build(seg_indptr, seg_slots, self.layout.max_rank, block_m=block_m, cover=pad_to)
        bound = padded_tile_bound(pad_to, block_m, self.pool.num_ids, self.max_seqs)
        if real.num_tiles > bound:
            raise ValueError(f"{real.num_tiles} LoRA tiles exceed the padded bound {bound}")
        classes = classes_of(bound)
        if tile_class == "auto":
            tile_class = next(c for c in classes if real.num_tiles <= class_grid(c, bound))
        elif tile_class is None:
            tile_class = bound
        elif tile_class not in classes:
            raise ValueError(f"tile class {tile_class!r} is not one of {classes} (pad_to={pad_to})")
        grid = class_grid(tile_class, bound)
        if real.num_tiles > grid:
            raise ValueError(f"{real.num_tiles} LoRA tiles exceed tile class {tile_class}'s grid of {grid}")
        info = BatchInfo(
            meta=real.meta,
            num_tokens=pad_to,
            num_tiles=grid,  # programs past the device header's count return at once
            block_m=block_m,
            max_len=pad_to,
            block_rank=real.block_rank,
            num_slots_used=real.num_slots_used,
            row_blocks=real.row_blocks,
        )
        key = (pad_to, block_m, tile_class, self.fuse_act)  # tools flip `fuse_act` to compare
        cached = self._padded_configs.get(key)
        if cached is None:  # configs as for the class's tile count
            cached = self._padded_configs[key] = self._make_configs(replace(info, num_tiles=tile_class))
        self._configs, self._info, self.tile_class = cached, info, tile_class

    def _make_configs(self, info: BatchInfo) -> dict[str, Configs]:
        max_split = split_cap(info.num_tokens, self._ws_rows)
        configs = {}
        for g in self.layout.groups:
            shrink_cfg = shrink_config(info, g.in_dim, g.num_slices, max_split)
            v = self.shrink_output(info, g, shrink_cfg)
            if self.fuses(g) and info.num_tokens > (self.max_seqs or FUSE_MIN_TOKENS):
                expand_cfg = expand_act_config(info, g.out_dims, v.shape[0])  # both kernels' configs
            else:
                expand_cfg = expand_config(info, g.out_dims, v.shape[0])
            configs[g.name] = (shrink_cfg, expand_cfg, v)
        return configs

    def shrink_output(self, info: BatchInfo, group: GroupLayout, cfg: ShrinkConfig) -> torch.Tensor:
        """The view the shrink writes for the expand: [cfg.parts, T, slices, block_rank] of a fixed
        buffer (the split-K partials' own when it does not reduce them)."""
        shape = (cfg.parts, info.num_tokens, group.num_slices, info.block_rank)
        buf = self._v if cfg.reduce else self._workspace
        return buf[: shape[0] * shape[1] * shape[2] * shape[3]].view(shape)

    def fuses(self, group: GroupLayout) -> bool:
        """Whether `apply_act` can fuse this group's expand into the activation (a batch of more tokens
        than sequences, whose configs then say so)."""
        return self.fuse_act and group.name == "gate_up" and fusable(group.out_offsets, group.out_dims)

    def configs_for(self, info: BatchInfo) -> dict[str, Configs]:
        """Per group: the kernel configs a forward with `info` runs, and its shrink output view (the
        warm-up plans every variant serving can reach from this)."""
        return self._make_configs(info)

    @contextmanager
    def _prepared_as(self, info: BatchInfo, configs: dict[str, Configs]):
        saved = self._info, self._configs
        self._info, self._configs = info, configs
        try:
            yield
        finally:
            self._info, self._configs = saved

    def apply_as(
        self,
        info: BatchInfo,
        configs: dict[str, Configs],
        x: torch.Tensor,
        out: torch.Tensor,
        layer: int,
        group: GroupLayout,
    ) -> None:
        """`apply` as if `prepare` had made `info` and `configs` (the warm-up's launches); the prepared
        batch is left as it was."""
        with self._prepared_as(info, configs):
            self.apply(x, out, layer, group)

    def apply_act_as(
        self,
        info: BatchInfo,
        configs: dict[str, Configs],
        x: torch.Tensor,
        gate_up: torch.Tensor,
        layer: int,
        group: GroupLayout,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`apply_act` as `apply_as` runs `apply`."""
        with self._prepared_as(info, configs):
            return self.apply_act(x, gate_up, layer, group, act)

    def apply_act(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        layer: int,
        group: GroupLayout,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        info = self._info
        if (
            info is None
            or info.num_tiles == 0
            or not isinstance(self._configs[group.name][1], ExpandActConfig)
        ):
            return super().apply_act(x, gate_up, layer, group, act)
        shrink_cfg, act_cfg, v = self._configs[group.name]
        a, b, ranks, scalings = self._views[layer, group.name]
        a_sc, b_sc = self._scales[layer, group.name]
        self._shrink(x, a, ranks, info, v, shrink_cfg, a_sc)
        return lora_expand_silu_mul(
            v,
            b,
            ranks,
            scalings,
            self.pool.rows,
            gate_up,
            info,
            config=act_cfg,
            check=False,
            pdl=True,
            b_scales=b_sc,
        )

    def _shrink(self, x, a, ranks, info: BatchInfo, v: torch.Tensor, cfg: ShrinkConfig, a_sc) -> None:
        lora_shrink(
            x,
            a,
            ranks,
            self.pool.rows,
            info,
            out=v,
            partials=self._workspace,
            counters=self._counters,
            config=cfg,
            check=False,
            pdl=True,
            a_scales=a_sc,
        )

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, group: GroupLayout) -> None:
        info = self._info
        if info is None:
            raise RuntimeError("TritonLoraBackend.apply called before prepare")
        if info.num_tiles == 0:
            return
        shrink_cfg, expand_cfg, v = self._configs[group.name]
        if isinstance(expand_cfg, ExpandActConfig):  # a fused group, asked for the delta alone
            expand_cfg = expand_cfg.expand
        a, b, ranks, scalings = self._views[layer, group.name]
        a_sc, b_sc = self._scales[layer, group.name]
        # The views and configs were made here, once; the kernels' argument checks would cost a
        # measurable share of an eager step's host time (128 launches per forward of a 16-layer model).
        self._shrink(x, a, ranks, info, v, shrink_cfg, a_sc)
        lora_expand(
            v,
            b,
            ranks,
            scalings,
            self.pool.rows,
            out,
            group.out_offsets,
            group.out_dims,
            info,
            config=expand_cfg,
            check=False,
            pdl=True,
            b_scales=b_sc,
        )
