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
    first: tuple[int, ...] = (1, 7, 24, 13, 16),
    choices: tuple[int, ...] = tuple(RANK_CHOICES),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mem [S, L, R, row] random with NaN in every row past a slice's rank (stale data that must never be
    read), ranks [S, L, 7] int32 drawn from `choices` (slice 0 of slot s: first[s % len(first)]) and 0
    for the `empty` slots, scalings [S, L, 7] fp32; CPU tensors."""
    mem = torch.randn((num_slots, layout.num_layers, layout.max_rank, layout.row_elems), generator=gen)
    pick = torch.randint(0, len(choices), (num_slots, layout.num_layers, NUM_SLICES), generator=gen)
    ranks = torch.tensor(choices, dtype=torch.int32)[pick]
    ranks[:, :, 0] = torch.tensor([first[s % len(first)] for s in range(num_slots)], dtype=torch.int32)[
        :, None
    ]
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


# Adapters of ranks above 64 (block rank 128) in a pool: slice 0 of id s has rank LARGE_FIRST[s], the
# other slices draw from LARGE_CHOICES (80 and 128 with odd and small ones); id 4 is empty.
LARGE_FIRST = (80, 1, 128, 33, 0, 128)
LARGE_CHOICES = (1, 7, 80, 128, 0, 65, 100)


def owned_rows(ranks: torch.Tensor) -> list[int]:
    """Rank rows each adapter owns in a pool: its largest rank over layers and slices ([I, L, 7] in)."""
    return [int(r) for r in ranks.flatten(1).amax(1)]


def scatter_to_pool(
    gen: torch.Generator, mem: torch.Tensor, owned: list[int], width: int, spare: int = 7
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy adapter i's first owned[i] rank rows of mem [I, L, R, row] to random, interleaved, out-of-order
    rows of a pool [L, P, row] that also holds `spare` NaN rows; table [I, width] int32 maps (i, k) to
    the pool row. Entries past owned[i] point at NaN rows: a read through them shows. CPU tensors."""
    num_ids, num_layers, _, row = mem.shape
    total = sum(owned) + spare
    perm = torch.randperm(total, generator=gen)
    pool = torch.full((num_layers, total, row), float("nan"), dtype=mem.dtype)
    poison = perm[sum(owned) :]
    table = poison[torch.randint(0, spare, (num_ids, width), generator=gen)].to(torch.int32)
    order = torch.randperm(num_ids, generator=gen).tolist()  # adapters take their rows in random order
    taken = 0
    for i in order:
        table[i, : owned[i]] = perm[taken : taken + owned[i]].to(torch.int32)
        taken += owned[i]
        pool[:, table[i, : owned[i]].long()] = mem[i, :, : owned[i]]
    return pool, table


def pool_operands(
    gen: torch.Generator, mem: torch.Tensor, ranks: torch.Tensor, layout: LoraLayout, kind: str, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool rows [L, P, row] or [P, row] per layer via `layer_rows`, row table) on `device` for the
    slot memory itself (kind "slots": the identity table of the backend) or a scattered pool."""
    if kind == "slots":
        return mem.to(device), layout.slot_row_table(mem.shape[0], device)
    pool, table = scatter_to_pool(gen, mem, owned_rows(ranks), layout.max_rank)
    return pool.to(device), table.to(device)


def layer_rows(base: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
    """[P, row] rank rows of `layer`: a row view of slot memory, or the pool's layer."""
    return LoraLayout.slot_rows(base, layer) if kind == "slots" else base[layer]


def make_v(gen, indptr, seg_slots, ranks, splits, block_rank):
    """fp32 partials [splits, T, N, block_rank] as the shrink leaves them: random below the rank, zeros
    up to the next multiple of 16, NaN (never written) elsewhere."""
    T, num_slices = indptr[-1], ranks.shape[1]
    v = torch.full((splits, T, num_slices, block_rank), float("nan"))
    for i, slot in enumerate(seg_slots):
        lo, hi = indptr[i], indptr[i + 1]
        for s in range(num_slices):
            r = int(ranks[slot, s]) if slot >= 0 else 0
            v[:, lo:hi, s, :r] = torch.randn((splits, hi - lo, r), generator=gen)
            v[:, lo:hi, s, r : (r + 15) // 16 * 16] = 0.0
    return v


def expected_expand(out0, v, b, ranks, scalings, offsets, dims, indptr, seg_slots):
    """float64 result and the mask of output entries the kernel may change."""
    ref = out0.double().clone()
    touched = torch.zeros(out0.shape, dtype=torch.bool)
    vsum = v.sum(0).to(b.dtype).double()  # the kernel feeds v to the dot in the weight dtype
    for i, slot in enumerate(seg_slots):
        lo, hi = indptr[i], indptr[i + 1]
        if slot < 0 or hi == lo:
            continue
        for s, (off, w) in enumerate(zip(offsets, dims, strict=True)):
            r = int(ranks[slot, s])
            if r == 0:
                continue
            delta = vsum[lo:hi, s, :r] @ b[slot, :r, off : off + w].double()
            ref[lo:hi, off : off + w] += float(scalings[slot, s]) * delta
            touched[lo:hi, off : off + w] = True
    return ref, touched
