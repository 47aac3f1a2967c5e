"""Where each adapter tensor lives inside a LoRA slot: one contiguous block per slot, layer-major,
rank rows within a layer, so a rank-r adapter is a prefix of r rows per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.common.model_config import DTYPE_BYTES

if TYPE_CHECKING:  # sizes need no torch: the launcher sizes the host cache before any stage imports it
    import torch

# Every LoRA target the runtime supports, in slice-id order (index into per-slot rank/scaling tables).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_SLICES = len(TARGET_MODULES)
ALIGN = 8  # elements; keeps every A/B row start 16-byte aligned for bf16/fp16


def _itemsize(dtype: torch.dtype | str) -> int:
    """Bytes of one element: a serving dtype by name, or any torch dtype."""
    return DTYPE_BYTES[dtype] if isinstance(dtype, str) else dtype.itemsize


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class GroupLayout:
    """One fused projection (qkv, o, gate_up, down) and where its A and B rows sit in a rank row."""

    name: str
    modules: tuple[str, ...]  # PEFT module names, in slice order
    first_slice: int  # slice id of modules[0]; the group's slice ids are consecutive
    in_dim: int
    in_stride: int  # elements between two slices' A rows inside one rank row (in_dim aligned)
    out_dims: tuple[int, ...]
    out_offsets: tuple[int, ...]  # column offset of each slice in the fused output
    a_offset: int  # element offset of A inside a rank row; A takes len(modules) * in_stride
    b_offset: int  # element offset of B^T inside a rank row; B^T takes out_total

    @property
    def num_slices(self) -> int:
        return len(self.modules)

    @property
    def out_total(self) -> int:
        return sum(self.out_dims)


@dataclass(frozen=True)
class LoraLayout:
    """Slot memory is `[num_slots, num_layers, max_rank, row_elems]`; rank row k of layer l holds,
    for every group, row k of each slice's A (lora_A[k, :]) and column k of B (lora_B[:, k])."""

    num_layers: int
    max_rank: int
    groups: tuple[GroupLayout, ...]
    row_elems: int

    @classmethod
    def build(
        cls, *, num_layers: int, hidden: int, q_out: int, kv_out: int, intermediate: int, max_rank: int
    ) -> LoraLayout:
        specs = (
            ("qkv", ("q_proj", "k_proj", "v_proj"), hidden, (q_out, kv_out, kv_out)),
            ("o", ("o_proj",), q_out, (hidden,)),
            ("gate_up", ("gate_proj", "up_proj"), hidden, (intermediate, intermediate)),
            ("down", ("down_proj",), intermediate, (hidden,)),
        )
        groups, off = [], 0
        for name, modules, in_dim, out_dims in specs:
            in_stride = _align(in_dim)
            a_offset = off
            off += len(modules) * in_stride
            b_offset = off
            off += _align(sum(out_dims))
            offsets = tuple(sum(out_dims[:i]) for i in range(len(out_dims)))
            groups.append(
                GroupLayout(
                    name=name,
                    modules=modules,
                    first_slice=TARGET_MODULES.index(modules[0]),
                    in_dim=in_dim,
                    in_stride=in_stride,
                    out_dims=out_dims,
                    out_offsets=offsets,
                    a_offset=a_offset,
                    b_offset=b_offset,
                )
            )
        return cls(num_layers=num_layers, max_rank=max_rank, groups=tuple(groups), row_elems=off)

    @classmethod
    def for_model(cls, cfg, max_rank: int) -> LoraLayout:
        """The layout for a `ModelConfig` (what the loader packs for and the worker's slots hold)."""
        return cls.build(
            num_layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            q_out=cfg.q_size,
            kv_out=cfg.kv_size,
            intermediate=cfg.intermediate_size,
            max_rank=max_rank,
        )

    def group(self, name: str) -> GroupLayout:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def module_slot(self, module: str) -> tuple[GroupLayout, int]:
        """The group holding a PEFT target module and the module's index inside that group."""
        for g in self.groups:
            if module in g.modules:
                return g, g.modules.index(module)
        raise KeyError(module)

    @property
    def layer_elems(self) -> int:
        return self.max_rank * self.row_elems

    def slot_bytes(self, dtype: torch.dtype | str) -> int:
        return self.num_layers * self.layer_elems * _itemsize(dtype)

    def block_bytes(self, rank: int, dtype: torch.dtype | str) -> int:
        """Bytes of a packed adapter whose largest rank is `rank` (what one load copies)."""
        return self.num_layers * rank * self.row_elems * _itemsize(dtype)

    # Views into slot memory (or into one packed block shaped [num_layers, rank, row_elems]).
    @staticmethod
    def a_view(mem: torch.Tensor, layer: int, g: GroupLayout) -> torch.Tensor:
        """[..., rank, num_slices, in_dim] view of A for `layer` (mem is [..., layers, rank, row])."""
        return LoraLayout.a_rows(mem.select(-3, layer), g)

    @staticmethod
    def b_view(mem: torch.Tensor, layer: int, g: GroupLayout) -> torch.Tensor:
        """[..., rank, out_total] view of B^T for `layer`."""
        return LoraLayout.b_rows(mem.select(-3, layer), g)

    # Views of rank rows [..., rows, row_elems]: one layer of a rank-paged pool, or `slot_rows`.
    @staticmethod
    def a_rows(rows: torch.Tensor, g: GroupLayout) -> torch.Tensor:
        """[..., rows, num_slices, in_dim] view of A in rank rows [..., rows, row_elems]."""
        a = rows[..., g.a_offset : g.a_offset + g.num_slices * g.in_stride]
        return a.unflatten(-1, (g.num_slices, g.in_stride))[..., : g.in_dim]

    @staticmethod
    def b_rows(rows: torch.Tensor, g: GroupLayout) -> torch.Tensor:
        """[..., rows, out_total] view of B^T in rank rows [..., rows, row_elems]."""
        return rows[..., g.b_offset : g.b_offset + g.out_total]

    @staticmethod
    def slot_rows(mem: torch.Tensor, layer: int) -> torch.Tensor:
        """Slot memory [S, L, R, row] seen as one layer of a rank-paged pool: [(S-1)*L*R + R, row] rows
        from mem[0, layer] on, where slot s's rank row k of `layer` is row s*L*R + k (`slot_row_table`)."""
        S, L, R, row = mem.shape
        flat = mem.view(S * L * R, row)  # no copy: slot memory is one contiguous block
        return flat[layer * R : layer * R + (S - 1) * L * R + R]

    def slot_row_table(self, num_slots: int, device: torch.device | str) -> torch.Tensor:
        """int32 [num_slots, max_rank]: the row table of `slot_rows` (slot s, rank row k -> s*L*R + k)."""
        import torch

        L, R = self.num_layers, self.max_rank
        if num_slots * L * R > 2**31 - 1:
            raise ValueError(f"{num_slots} slots x {L} layers x rank {R} rows overflow an int32 row table")
        rows = torch.arange(num_slots, dtype=torch.int64)[:, None] * (L * R) + torch.arange(R)
        return rows.to(torch.int32).to(device)  # [num_slots, max_rank]
