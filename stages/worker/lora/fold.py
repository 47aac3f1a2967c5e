"""The Triton backend's "fold" design for batches of at most `max_seqs` tokens (decode): each group's LoRA
runs inside the kernels around its projection instead of launches of its own (`kernels/lora_fold_*.py`).
A layer then runs: input norm (+ the previous layer's down expand, + the q/k/v shrink), QKV, rotary and
K/V write (+ the q/k/v expand), attention, o's shrink (the one LoRA launch of the layer: its input is
attention's output; on CUDA on a side stream beside O), O, post-attention norm (+ o's expand, + the
gate/up shrink), gate/up, activation (+ its expand, + the down shrink), down; the last down expand goes
into the final norm. `LlamaModel` asks the backend for this (`folds`) and calls these steps in that
order; every buffer here is allocated once, so captured graphs hold their addresses. Tensor-parallel
ranks keep the serial design."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from os import environ

import torch

from kernels import device_info
from kernels.batch_info import block_rank_for
from kernels.lora_fold_act import MAX_PARTIALS, act_blocks, fold_silu_mul
from kernels.lora_fold_norm import MAX_SPLITS, fold_norm, norm_splits
from kernels.lora_fold_parts import FoldExpand, FoldShrink, tile_block
from kernels.lora_fold_rope import fold_rope_kv

# Set to 0 to launch o's shrink in stream order before the O projection rather than beside it (A/B runs).
FOLD_SIDE_ENV = "LORAPIPE_FOLD_SIDE"


class FoldLora:
    """The fold steps of one forward over `backend`'s prepared batch (a `TritonLoraBackend`: its views,
    scales, row table, o's shrink config). Between the steps it holds the v each shrink left for the
    expand of a later step."""

    def __init__(self, backend, max_tokens: int):
        """`max_tokens`: the most tokens of a batch this design serves (the backend's decode class)."""
        self.backend = backend
        self.max_tokens = max_tokens
        layout = backend.layout
        br = block_rank_for(layout.max_rank)
        dev = backend.pool.device
        f32 = torch.float32
        n = max_tokens * br
        self._v_qkv = torch.empty(MAX_SPLITS * n * 3, dtype=f32, device=dev)  # [splits, T, 3, br]
        self._v_gu = torch.empty(MAX_SPLITS * n * 2, dtype=f32, device=dev)  # [splits, T, 2, br]
        self._v_down = torch.empty(MAX_PARTIALS * n, dtype=f32, device=dev)  # [groups, T, 1, br]
        self._inv_in = torch.empty(max_tokens, dtype=f32, device=dev)  # each row's 1 / rms
        self._inv_post = torch.empty(max_tokens, dtype=f32, device=dev)
        self._qkv: FoldShrink | None = None  # what the last input norm left for the rotary
        self._gu: FoldShrink | None = None  # the post-attention norm's, for the activation
        self._down: FoldShrink | None = None  # the activation's, for the next norm
        # o's shrink needs attention's output alone, so on CUDA it runs on a side stream beside the O
        # GEMM (`side_o`; off: in stream order before it), joined before the post-attention norm
        cuda = dev.type == "cuda"
        self._side = torch.cuda.Stream(dev, priority=-1) if cuda else None
        self._fork, self._join = (torch.cuda.Event(), torch.cuda.Event()) if cuda else (None, None)
        self.side_o = cuda and environ.get(FOLD_SIDE_ENV, "1") != "0"
        self._forked = False

    def _pdl(self) -> bool:
        """Whether the fold kernels launch as programmatic dependents (`device_info.pdl_for`): each reads
        only the step's constant data (tiles, adapter tables) before its wait, which no kernel of the
        step writes."""
        info = self.backend.batch_info
        return device_info.pdl_for(info.meta.device, info.num_tiles)

    def serves(self, num_tokens: int, num_tiles: int) -> bool:
        return 0 < num_tiles and num_tokens <= self.max_tokens

    def variant(self, info, configs: dict) -> tuple:
        """What the fold steps' compiled variants read of a batch beyond its token and rank tiles and the
        server's fixed sizes (token and tile counts are not specialised on): of `info` as launched, the
        tile count, which sets the tile search's width and whether they launch as dependents; of the
        `configs` it was prepared with, o's shrink config as `shrink_o` launches it and the partials its
        expand sums. The warm-up plans one launch per answer (`warmup_plan.lora_launches`)."""
        o_cfg, _, o_v = configs["o"]
        pdl = device_info.pdl_for(info.meta.device, info.num_tiles)
        return (
            tile_block(info.num_tiles),
            pdl,
            o_v.shape[0],
            replace(o_cfg, pdl=False) if self.side_o else o_cfg,
        )

    @contextmanager
    def as_batch(self, info, configs: dict):
        """Within: the steps run as if the backend had prepared `info` and `configs` (the warm-up's
        launches, whose device header says 0 tiles)."""
        with self.backend._prepared_as(info, configs):
            yield self

    @staticmethod
    def _view(buf: torch.Tensor, parts: int, T: int, slices: int, br: int) -> torch.Tensor:
        return buf[: parts * T * slices * br].view(parts, T, slices, br)

    def _shrink(self, layer: int, group: str, buf, parts: int, inv) -> FoldShrink:
        b = self.backend
        info = b.batch_info
        a, _, ranks, _ = b._views[layer, group]
        v = self._view(buf, parts, info.num_tokens, ranks.shape[1], info.block_rank)
        return FoldShrink(a, ranks, v, b._scales[layer, group][0], inv)

    def _expand(self, layer: int, group: str, v: torch.Tensor, inv=None) -> FoldExpand:
        _, b, ranks, scalings = self.backend._views[layer, group]
        return FoldExpand(v, b, ranks, scalings, self.backend._scales[layer, group][1], inv)

    def _norm_shrink(self, layer: int, group: str, buf, inv_buf) -> FoldShrink:
        info = self.backend.batch_info
        splits = norm_splits(self.backend.layout.group(group).in_dim)
        return self._shrink(layer, group, buf, splits, inv_buf[: info.num_tokens])

    def input_norm(self, layer: int, h, down, weight, eps: float):
        """Layer `layer`'s input norm of h + down (down: the previous layer's down projection, whose delta
        this adds; None for the first layer). Returns (the residual, the normed rows)."""
        b = self.backend
        self._qkv = self._norm_shrink(layer, "qkv", self._v_qkv, self._inv_in)
        expand = None if down is None else self._expand(layer - 1, "down", self._down.v)
        total, x = fold_norm(
            h,
            weight,
            eps,
            b.batch_info,
            b.rows,
            d=down,
            expand=expand,
            shrink=self._qkv,
            check=False,
            pdl=self._pdl(),
        )
        return (h if total is None else total), x

    def rope_kv(self, layer: int, qkv, cos, sin, kv_rows, kv, num_heads: int, num_kv_heads: int):
        b = self.backend
        expand = self._expand(layer, "qkv", self._qkv.v, self._qkv.inv)
        return fold_rope_kv(
            qkv, cos, sin, kv_rows, kv.k[layer], kv.v[layer], num_heads, num_kv_heads, expand,
            b.batch_info, b.rows, check=False, pdl=self._pdl(),
        )  # fmt: skip

    def shrink_o(self, layer: int, attn: torch.Tensor) -> None:
        """o's shrink of attention's output `attn`, called before the O projection: with `side_o` on a
        side stream forked here and joined by `post_norm` (attn must live until then: the forward holds
        it), else in stream order as the serial design launches it."""
        b = self.backend
        cfg, _, v = b._configs["o"]
        a, _, ranks, _ = b._views[layer, "o"]
        a_sc = b._scales[layer, "o"][0]
        if not self.side_o:
            b._shrink(attn, a, ranks, b.batch_info, v, cfg, a_sc)
            return
        self._fork.record(torch.cuda.current_stream(attn.device))
        self._side.wait_event(self._fork)
        with torch.cuda.stream(self._side):  # plain order: its predecessor is an event
            b._shrink(attn, a, ranks, b.batch_info, v, replace(cfg, pdl=False), a_sc)
        self._join.record(self._side)
        self._forked = True

    def post_norm(self, layer: int, h, o, weight, eps: float):
        """h + o (+ o's delta) and its norm, the gate/up shrink of the normed rows."""
        b = self.backend
        pdl = self._pdl()
        if self._forked:  # o's shrink on the side stream: joined here, and this launch in plain order
            torch.cuda.current_stream(h.device).wait_event(self._join)
            self._forked, pdl = False, False
        self._gu = self._norm_shrink(layer, "gate_up", self._v_gu, self._inv_post)
        expand = self._expand(layer, "o", b._configs["o"][2])
        return fold_norm(
            h,
            weight,
            eps,
            b.batch_info,
            b.rows,
            d=o,
            expand=expand,
            shrink=self._gu,
            check=False,
            pdl=pdl,
        )

    def act(self, layer: int, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up with gate/up's delta, and the down shrink of the result."""
        b = self.backend
        info = b.batch_info
        _, _, groups = act_blocks(gate_up.shape[1] // 2, info.block_rank)
        self._down = self._shrink(layer, "down", self._v_down, groups, None)
        expand = self._expand(layer, "gate_up", self._gu.v, self._gu.inv)
        return fold_silu_mul(gate_up, expand, info, b.rows, self._down, check=False, pdl=self._pdl())

    def final_norm(self, layer: int, h, down, weight, eps: float) -> torch.Tensor:
        """The final norm of h + down (+ the down delta of the last layer, `layer`), every row."""
        b = self.backend
        expand = self._expand(layer, "down", self._down.v)
        pdl = self._pdl()
        return fold_norm(h, weight, eps, b.batch_info, b.rows, d=down, expand=expand, check=False, pdl=pdl)[1]
