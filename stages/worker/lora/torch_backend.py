"""Plain-torch LoRA backend: one pair of matmuls per (segment, slice), gathering each adapter's pool rows
through the row table's host mirror, with ranks from the host mirror too: nothing is read back from the
device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora_quant import a_scales, b_scales
from runtime.common.lora_layout import GroupLayout, LoraLayout
from stages.worker.lora.backend import LoraBackend


class TorchLoraBackend(LoraBackend):
    name = "torch"

    def prepare(
        self,
        seg_indptr: Sequence[int],
        seg_slots: Sequence[int],
        pad_to: int | None = None,
        block_m: int | None = None,
        tile_class: int | str | None = None,
    ) -> None:
        # Merge runs of one adapter; drop base-only segments.
        segs: list[tuple[int, int, int]] = []
        for i, lora_id in enumerate(seg_slots):
            if lora_id < 0:
                continue
            start, end = seg_indptr[i], seg_indptr[i + 1]
            if segs and segs[-1][2] == lora_id and segs[-1][1] == start:
                segs[-1] = (segs[-1][0], end, lora_id)
            elif end > start:
                segs.append((start, end, lora_id))
        self._segments = segs
        pool, ids = self.pool, {s for _, _, s in segs}
        # per id: its pool rows in rank order as a device index [largest rank], ranks and scalings
        # [num_layers][NUM_SLICES] as host lists
        self._rows = {
            i: pool.host_rows[i, : int(pool.host_ranks[i].max())].to(pool.device, torch.int64) for i in ids
        }
        self._ranks = {i: pool.host_ranks[i].tolist() for i in ids}
        self._scalings = {i: pool.host_scalings[i].tolist() for i in ids}

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, group: GroupLayout) -> None:
        if not self._segments:
            return
        a_all = LoraLayout.a_view(self.pool.mem, layer, group)  # [total_rows, n_slices, in]
        b_all = LoraLayout.b_view(self.pool.mem, layer, group)  # [total_rows, out_total]
        scales = self.pool.scales  # e4m3 pools: [L, total_rows, NUM_SCALES] fp32
        a_sc = b_sc = None
        if scales is not None:
            a_sc = a_scales(scales[layer], group.first_slice, group.num_slices)  # [total_rows, n]
            b_sc = b_scales(scales[layer], group.first_slice, group.num_slices)
        for start, end, lora_id in self._segments:
            xs = x[start:end]  # [n, in]
            rows = self._rows[lora_id]
            ranks, scalings = self._ranks[lora_id][layer], self._scalings[lora_id][layer]
            for i in range(group.num_slices):
                sid = group.first_slice + i
                r = ranks[sid]
                if r == 0:
                    continue
                off, width = group.out_offsets[i], group.out_dims[i]
                a, b = a_all[rows[:r], i, :], b_all[rows[:r], off : off + width]  # [r, in], [r, width]
                if a_sc is not None:  # e4m3 rows times their scales, in x's dtype
                    a = (a.float() * a_sc[rows[:r], i, None]).to(xs.dtype)
                    b = (b.float() * b_sc[rows[:r], i, None]).to(xs.dtype)
                v = xs @ a.t()  # [n, r]
                delta = v @ b  # [n, width]
                out[start:end, off : off + width] += delta * scalings[sid]
