"""Reads a PEFT LoRA adapter directory: validates adapter_config.json and every tensor's name, dtype and
shape against the base model from the safetensors header alone (`plan_adapter`, on `adapter_check`), then
packs the tensor data into the slot layout (`read_adapter` into a fresh tensor; the loader into its pool
block)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.common.packed import PackedAdapter
from stages.loader.adapter_check import TENSORS_FILE, max_file_bytes, open_placed
from stages.loader.adapter_plan import AdapterPlan, ReadLimits, make_gaps
from stages.loader.block_writer import write_all
from stages.loader.delta_bound import check_packed_deltas
from stages.loader.segments import make_segments

__all__ = ["max_file_bytes", "plan_adapter", "read_adapter"]


def read_adapter(
    name: str,
    path: str | Path,
    cfg: ModelConfig,
    layout: LoraLayout,
    dtype: torch.dtype,
    pin_memory: bool = False,
    limits: ReadLimits | None = None,
) -> PackedAdapter:
    """The in-process form (offline engine, tools): plan, then pack into a fresh tensor (pinned or not)."""
    with plan_adapter(name, path, cfg, layout, dtype, limits) as plan:
        block = torch.empty(plan.shape, dtype=dtype, pin_memory=pin_memory)  # [num_layers, rank, row_elems]
        write_all(plan, block)
    check_packed_deltas(name, layout, block, plan.ranks, plan.scalings, plan.peak)
    return PackedAdapter(name=name, block=block, ranks=plan.ranks, scalings=plan.scalings)


def plan_adapter(
    name: str,
    path: str | Path,
    cfg: ModelConfig,
    layout: LoraLayout,
    dtype: torch.dtype,
    limits: ReadLimits | None = None,
) -> AdapterPlan:
    """Everything but the values checked, the tensor file left open in the plan (the caller closes it)."""
    limits = limits or ReadLimits(max_file_bytes=max_file_bytes(layout))
    fd, size, placed, deadline = open_placed(name, path, cfg, layout, limits)
    try:
        return AdapterPlan(
            name=name,
            fd=fd,
            dtype=dtype,
            rank=placed.rank,
            num_layers=layout.num_layers,
            row_elems=layout.row_elems,
            ranks=torch.tensor(placed.ranks, dtype=torch.int32),  # [num_layers, NUM_SLICES]
            scalings=torch.tensor(placed.scalings, dtype=torch.float32),  # [num_layers, NUM_SLICES]
            segments=make_segments(placed.pieces, limits),
            gaps=make_gaps(layout, placed.rank, placed.ranks),
            deadline=deadline,
            file_bytes=size,
            path=str(Path(path) / TENSORS_FILE),
        )
    except BaseException:
        os.close(fd)
        raise
