"""Triton LoRA backend: the batch's token tiles are planned once per forward on the host and moved with
one non-blocking copy into a fixed device buffer; each `apply` is one shrink and one expand launch whose
grids come from host-known sizes, with ranks, scalings and adapter rows read on the device through
fixed tables (no host-device sync). How a group's launches meet its base projection is the backend's
`design` (DESIGNS): in stream order after it, the shrink on a side stream beside it, or the shrink and
expand of a batch that holds no prefill run as one launch after it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import replace
from os import environ

import torch

from kernels.batch_info import BatchInfo, BatchInfoBuilder, block_rank_for
from kernels.lora_expand import ExpandConfig, expand_config, lora_expand
from kernels.lora_expand_act import ExpandActConfig, expand_act_config, fusable, lora_expand_silu_mul
from kernels.lora_fused import FusedConfig, lora_shrink_expand, sync_buffer
from kernels.lora_quant import a_scales, b_scales
from kernels.lora_shrink import ShrinkConfig, lora_shrink, shrink_config, split_counters
from runtime.common.lora_layout import GroupLayout, LoraLayout
from stages.worker.lora.backend import PADDED_BLOCK_M, LoraBackend
from stages.worker.lora.pool import LoraPool
from stages.worker.lora.tiles import class_grid, classes_of, padded_tile_bound, split_cap, workspace_rows

# The gate_up group's expand is fused into the activation (kernels/lora_expand_act.py) for batches of more
# tokens than sequences (`max_seqs`, else this), which hold prefill runs: on an H100 it cuts a step's LoRA and
# activation time by 24 % at 31 x 256 prefill tokens and 8 % at 4 x 1,024, while 256-decode steps are 2-4 %
# slower with it.
FUSE_MIN_TOKENS = 256
# Per group: kernel configs (the gate_up group's expand config is an ExpandActConfig when it is fused with
# the activation; a FusedConfig when the shrink and expand are one launch), shrink output view.
Configs = tuple[ShrinkConfig, ExpandConfig | ExpandActConfig | FusedConfig, torch.Tensor]
# "serial": shrink and expand in stream order after the base projection (dependent launches where the
# device has them). "side": the shrink, which needs the projection's input alone, on a side stream forked
# before the projection and joined before the expand (`begin`), so that it runs beside the GEMM.
# "fused": shrink and expand as one launch (kernels/lora_fused.py) in batches without prefill runs.
DESIGNS = ("serial", "side", "fused")
DESIGN_ENV = "LORAPIPE_LORA_DESIGN"  # one of DESIGNS, for A/B runs
DEFAULT_DESIGN = "serial"


def no_pdl(cfg: ExpandConfig | ExpandActConfig) -> ExpandConfig | ExpandActConfig:
    """`cfg` launched in plain stream order (its kernel variants say so: the warm-up compiles those)."""
    if isinstance(cfg, ExpandActConfig):
        return ExpandActConfig(expand=replace(cfg.expand, pdl=False), act=replace(cfg.act, pdl=False))
    return replace(cfg, pdl=False)


class TritonLoraBackend(LoraBackend):
    """The kernels read adapter weights as rank rows of the pool's layer `l` (`pool.mem[l]`, [total_rows,
    row_elems]) through its row table: adapter id i (the id of the batch segments, and the row of
    `pool.ranks`/`pool.scalings`) has its rank row k at pool row `pool.rows[i, k]`. The pool allocates
    these tensors once and only updates them in place in stream order before the forward that reads
    them (views and captured CUDA graphs hold their addresses); `rows[i, k]` is a valid pool row for
    every k below id i's largest rank (entries past it are loaded, never dereferenced)."""

    name = "triton"

    def __init__(
        self,
        pool: LoraPool,
        max_tokens: int,
        max_seqs: int | None = None,
        fuse_act: bool = True,
        design: str | None = None,
    ):
        """`fuse_act`: the gate_up group's expand and the activation in one kernel (`apply_act`).
        `design`: one of DESIGNS (None: $LORAPIPE_LORA_DESIGN, else DEFAULT_DESIGN)."""
        super().__init__(pool, max_tokens, max_seqs)
        self.fuse_act = fuse_act
        self.design = design or environ.get(DESIGN_ENV) or DEFAULT_DESIGN
        if self.design not in DESIGNS:
            raise ValueError(f"unknown LoRA design {self.design!r} (one of {', '.join(DESIGNS)})")
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
        # (pad_to, block_m, class, fuse_act, design) -> configs
        self._padded_configs: dict[tuple[int, int, int, bool, str], dict[str, Configs]] = {}

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
        self._sync = sync_buffer(self.max_tokens, dev)  # the fused launches' tickets and tile counters
        # "side": the stream the shrinks run on, the fork and join events, and the (layer, group) whose
        # shrink is in flight there
        side = self.design == "side" and dev.type == "cuda"
        self._side = torch.cuda.Stream(dev, priority=-1) if side else None
        self._fork, self._join = (torch.cuda.Event(), torch.cuda.Event()) if self._side else (None, None)
        self._pending: tuple[int, str] | None = None

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
        key = (pad_to, block_m, tile_class, self.fuse_act, self.design)  # tools flip these to compare
        cached = self._padded_configs.get(key)
        if cached is None:  # configs as for the class's tile count
            cached = self._padded_configs[key] = self._make_configs(replace(info, num_tiles=tile_class))
        self._configs, self._info, self.tile_class = cached, info, tile_class

    def token_class(self, num_tokens: int) -> tuple[int, bool]:
        """All that a batch's configs read of its token count (the warm-up plan relies on it): the split-K
        cap of the workspace, and whether it has more tokens than sequences (so holds prefill runs)."""
        return split_cap(num_tokens, self._ws_rows), num_tokens > (self.max_seqs or FUSE_MIN_TOKENS)

    def _make_configs(self, info: BatchInfo) -> dict[str, Configs]:
        max_split, prefill = self.token_class(info.num_tokens)
        # x in the model's dtype, A as the pool's rows hold it
        operand_bytes = (self.pool.dtype.itemsize, self.pool.mem.dtype.itemsize)
        configs = {}
        for g in self.layout.groups:
            shrink_cfg = shrink_config(info, g.in_dim, g.num_slices, max_split, operand_bytes=operand_bytes)
            v = self.shrink_output(info, g, shrink_cfg)
            if self.fuses(g) and prefill:
                expand_cfg = expand_act_config(info, g.out_dims, v.shape[0])  # both kernels' configs
            elif self.design == "fused" and not prefill:
                shrink_cfg = replace(shrink_cfg, reduce=False)  # the expand programs sum the partials
                v = self.shrink_output(info, g, shrink_cfg)
                expand_cfg = FusedConfig(expand_config(info, g.out_dims, shrink_cfg.split_k))
            else:
                expand_cfg = expand_config(info, g.out_dims, v.shape[0])
            if self.design == "side":  # no dependent launches: the side shrink's and the joined
                shrink_cfg, expand_cfg = replace(shrink_cfg, pdl=False), no_pdl(expand_cfg)  # expand's
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
        _, act_cfg, v = self._configs[group.name]
        _, b, ranks, scalings = self._views[layer, group.name]
        b_sc = self._scales[layer, group.name][1]
        self._shrink_or_join(x, layer, group)
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

    def begin(self, x: torch.Tensor, layer: int, group: GroupLayout) -> None:
        """ "side": fork the side stream from the current one and launch the group's shrink there (its
        expand, in `apply`/`apply_act`, joins it). The other designs start nothing before the GEMM."""
        info = self._info
        if self.design != "side" or self._side is None or info is None or info.num_tiles == 0:
            return
        shrink_cfg, _, v = self._configs[group.name]
        a, _, ranks, _ = self._views[layer, group.name]
        self._fork.record(torch.cuda.current_stream(x.device))
        self._side.wait_event(self._fork)
        with torch.cuda.stream(self._side):  # its config says plain order: its predecessor is an event
            self._shrink(x, a, ranks, info, v, shrink_cfg, self._scales[layer, group.name][0])
        self._join.record(self._side)
        self._pending = (layer, group.name)

    def _shrink_or_join(self, x: torch.Tensor, layer: int, group: GroupLayout) -> None:
        """Join the side stream where `begin` launched this group's shrink there, else launch it here.
        Every fork is joined before the next group's: the shrinks share the partials buffer."""
        if self._pending == (layer, group.name):
            self._pending = None
            torch.cuda.current_stream(x.device).wait_event(self._join)
            return
        shrink_cfg, _, v = self._configs[group.name]
        a, _, ranks, _ = self._views[layer, group.name]
        self._shrink(x, a, ranks, self._info, v, shrink_cfg, self._scales[layer, group.name][0])

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
        if isinstance(expand_cfg, FusedConfig):
            lora_shrink_expand(
                x, a, b, ranks, scalings, self.pool.rows, out, group.out_offsets, group.out_dims, info,
                v=v, sync=self._sync, shrink=shrink_cfg, expand=expand_cfg.expand, check=False, pdl=True,
                a_scales=a_sc, b_scales=b_sc,
            )  # fmt: skip
            return
        self._shrink_or_join(x, layer, group)
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
