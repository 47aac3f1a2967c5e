"""Kernel tests run the real kernels on CUDA tensors when a GPU is present, else on the CPU under the
Triton interpreter (set here, before anything imports triton); plus shared random-case builders."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative error bounds (norm of the difference over norm of the float64 reference) per dtype.
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 5e-3}  # fp32: tf32 dot on GPU


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def small_layout(max_rank: int = 24, num_layers: int = 2) -> LoraLayout:
    """Widths that are not multiples of 16 and q/k/v slices of unequal width."""
    return LoraLayout.build(
        num_layers=num_layers, hidden=40, q_out=48, kv_out=20, intermediate=56, max_rank=max_rank
    )


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# Segment lengths of one mixed batch (ragged, some not multiples of any block, one empty) and their
# slots: -1 = base only, adjacent equal slots (merged), slot 4 is empty (rank 0 everywhere).
MIXED_LENGTHS = [3, 17, 1, 0, 20, 1, 1, 5, 33, 2, 1]
MIXED_SLOTS = [0, -1, 2, 1, 1, 3, 3, -1, 4, 2, 0]
RANK_CHOICES = [1, 7, 13, 16, 24, 0]


def indptr_of(lengths: list[int]) -> list[int]:
    indptr = [0]
    for n in lengths:
        indptr.append(indptr[-1] + n)
    return indptr


def random_slot_tables(
    gen: torch.Generator,
    layout: LoraLayout,
    num_slots: int,
    dtype: torch.dtype,
    empty: tuple[int, ...] = (4,),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mem [S, L, R, row] random with NaN in every row past a slice's rank (stale data that must never be
    read), ranks [S, L, 7] int32 mixing 1, odd ranks and 0, scalings [S, L, 7] fp32; CPU tensors."""
    mem = torch.randn((num_slots, layout.num_layers, layout.max_rank, layout.row_elems), generator=gen)
    pick = torch.randint(0, len(RANK_CHOICES), (num_slots, layout.num_layers, NUM_SLICES), generator=gen)
    ranks = torch.tensor(RANK_CHOICES, dtype=torch.int32)[pick]
    ranks[:, :, 0] = torch.tensor([1, 7, 24, 13, 16] * num_slots, dtype=torch.int32)[:num_slots, None]
    for s in empty:
        ranks[s] = 0
    scalings = torch.rand((num_slots, layout.num_layers, NUM_SLICES), generator=gen) * 2 + 0.25
    for slot in range(num_slots):
        for layer in range(layout.num_layers):
            for sid, module in enumerate(TARGET_MODULES):
                g, i = layout.module_slot(module)
                r = int(ranks[slot, layer, sid])
                a0 = g.a_offset + i * g.in_stride
                b0 = g.b_offset + g.out_offsets[i]
                mem[slot, layer, r:, a0 : a0 + g.in_dim] = float("nan")
                mem[slot, layer, r:, b0 : b0 + g.out_dims[i]] = float("nan")
    return mem.to(dtype), ranks, scalings
