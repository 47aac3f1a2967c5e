"""Kernel tests run the real kernels on CUDA tensors when a GPU is present, else on the CPU under the
Triton interpreter (set here, before anything imports triton); plus shared random-case builders."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from stages.worker.lora.layout import LoraLayout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative error bounds (norm of the difference over norm of the float64 reference) per dtype.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-3}


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def small_layout(max_rank: int = 24, num_layers: int = 2) -> LoraLayout:
    """Widths that are not multiples of 16 and q/k/v slices of unequal width."""
    return LoraLayout.build(num_layers=num_layers, hidden=40, q_out=48, kv_out=20, intermediate=56, max_rank=max_rank)


def random_segments(gen: torch.Generator, num_slots: int, lengths: list[int]) -> tuple[list[int], list[int]]:
    """Segments of the given lengths, each with a random slot or -1 (base only); adjacent segments may
    share a slot (the kernels' planner merges them)."""
    slots = torch.randint(-1, num_slots, (len(lengths),), generator=gen).tolist()
    indptr = [0]
    for n in lengths:
        indptr.append(indptr[-1] + n)
    return indptr, slots


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))
