"""The effective-delta bound of a packed adapter block (`check_delta_magnitude`'s rule) in one pass.

|(s * B @ A)[i, j]| <= s * ||B[i, :]|| * ||A[:, j]||, and a packed block keeps rank k of every A column
and of every B row in rank row k. So one float32 accumulation of squares over a layer's rank rows gives
the squared norm of every column of every A and every row of every B at once; a module's bound is its
largest B-row norm times its largest A-column norm. Rows past a module's own rank are zero in a packed
block (the writer zeroes every gap), so they add nothing. Cost: one read of the block, no matmul, no
copy of it (rank 16 of a 1B-shaped model: a few milliseconds, where a check per module took ~100)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from runtime.common.lora_layout import TARGET_MODULES, LoraLayout
from stages.loader.adapter_config import check_delta_magnitude, delta_limit


class _Module(NamedTuple):
    """One target module's place in a rank row: its A columns and B rows, and their reduceat segments."""

    sid: int  # slice id (index into TARGET_MODULES, and into a plan's ranks/scalings rows)
    name: str
    in_dim: int
    a: slice  # A [r, in_dim] at these columns of a rank row
    b: slice  # B^T [r, out_dim] at these columns
    seg_a: int  # index of A's segment among the reduceat starts
    seg_b: int


@lru_cache(maxsize=8)
def _layout_table(layout: LoraLayout) -> tuple[np.ndarray, tuple[_Module, ...]]:
    """`np.maximum.reduceat` starts over a rank row (every A and B range's start and end) and every
    target module's place. The ranges are disjoint, so the segment from a range's start to the next
    boundary is exactly that range."""
    places = []
    for module in TARGET_MODULES:
        g, i = layout.module_slot(module)
        a0, b0 = g.a_offset + i * g.in_stride, g.b_offset + g.out_offsets[i]
        places.append((module, g.in_dim, slice(a0, a0 + g.in_dim), slice(b0, b0 + g.out_dims[i])))
    bounds = sorted(
        {x for *_, a, b in places for x in (a.start, a.stop, b.start, b.stop) if x < layout.row_elems}
    )
    at = {x: n for n, x in enumerate(bounds)}
    modules = tuple(
        _Module(sid, name, in_dim, a, b, at[a.start], at[b.start])
        for sid, (name, in_dim, a, b) in enumerate(places)
    )
    return np.asarray(bounds, dtype=np.int64), modules


def column_sq_norms(block: torch.Tensor) -> torch.Tensor:
    """[num_layers, row_elems] float32: the sum over rank rows of each element's square."""
    layers, rank, row = block.shape
    out = torch.zeros(layers, row, dtype=torch.float32)
    tmp = torch.empty(row, dtype=torch.float32)
    for layer in range(layers):
        acc = out[layer]
        for k in range(rank):
            tmp.copy_(block[layer, k])
            acc.addcmul_(tmp, tmp)
    return out


# A value rounded to the block's dtype grows by at most its unit roundoff (bfloat16: 2**-8); this covers it.
_ROUNDING = 1 + 2**-7


def check_packed_deltas(
    name: str,
    layout: LoraLayout,
    block: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    peak: float | None = None,
) -> None:
    """Refuse the adapter (AdapterError naming module and layer) if any module's effective delta may pass
    `delta_limit`. `block` is [num_layers, rank, row_elems]; `ranks`/`scalings` [num_layers, slices].
    `peak`, the largest |value| of the adapter's tensors (the writer's value checks note it), gives a
    first bound for free: |(B @ A)[i, j]| <= r * peak**2. Only modules it cannot accept (none, for any
    trained adapter) pay for the norms."""
    starts, modules = _layout_table(layout)
    limits = [delta_limit(block.dtype, m.in_dim) for m in modules]
    rank_rows, scale_rows = ranks.tolist(), scalings.tolist()
    sq_max = None  # [layers, segments]: the largest squared norm per A / B range, taken on first need
    for layer in range(block.shape[0]):
        for m in modules:
            r = rank_rows[layer][m.sid]
            if r == 0:
                continue
            scaling, limit = float(scale_rows[layer][m.sid]), limits[m.sid]
            if not (math.isfinite(scaling) and scaling > 0):
                bound = math.nan
            elif peak is not None and scaling * r * (peak * _ROUNDING) ** 2 <= limit:
                continue
            else:
                if sq_max is None:
                    sq_max = np.maximum.reduceat(column_sq_norms(block).numpy(), starts, axis=1)
                bound = scaling * math.sqrt(float(sq_max[layer, m.seg_a]) * float(sq_max[layer, m.seg_b]))
            if math.isfinite(bound) and bound <= limit:
                continue
            # Over the limit, a bad scaling, or squares past float32 (entries beyond ~1e19): the exact
            # per-module check decides and names the reason.
            check_delta_magnitude(
                name,
                f"{m.name} of layer {layer}",
                block[layer, :r, m.a],
                block[layer, :r, m.b].t(),
                scaling,
                block.dtype,
            )
