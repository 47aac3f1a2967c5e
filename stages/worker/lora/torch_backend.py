"""Plain-torch LoRA backend: one pair of matmuls per (segment, slice), reading the slot tables' host
mirror for ranks so that nothing is read back from the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.common.lora_layout import GroupLayout, LoraLayout
from stages.worker.lora.backend import LoraBackend


class TorchLoraBackend(LoraBackend):
    name = "torch"

    def prepare(self, seg_indptr: Sequence[int], seg_slots: Sequence[int], pad_to: int | None = None) -> None:
        # Merge runs of one slot; drop base-only segments.
        segs: list[tuple[int, int, int]] = []
        for i, slot in enumerate(seg_slots):
            if slot < 0:
                continue
            start, end = seg_indptr[i], seg_indptr[i + 1]
            if segs and segs[-1][2] == slot and segs[-1][1] == start:
                segs[-1] = (segs[-1][0], end, slot)
            elif end > start:
                segs.append((start, end, slot))
        self._segments = segs

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, group: GroupLayout) -> None:
        if not self._segments:
            return
        a_all = LoraLayout.a_view(self.slots.mem, layer, group)  # [S, max_rank, n_slices, in]
        b_all = LoraLayout.b_view(self.slots.mem, layer, group)  # [S, max_rank, out_total]
        ranks = self.slots.host_ranks[:, layer].tolist()
        scalings = self.slots.host_scalings[:, layer].tolist()
        for start, end, slot in self._segments:
            xs = x[start:end]  # [n, in]
            for i in range(group.num_slices):
                sid = group.first_slice + i
                r = ranks[slot][sid]
                if r == 0:
                    continue
                off, width = group.out_offsets[i], group.out_dims[i]
                v = xs @ a_all[slot, :r, i, :].t()  # [n, r]
                delta = v @ b_all[slot, :r, off : off + width]  # [n, width]
                out[start:end, off : off + width] += delta * scalings[slot][sid]
