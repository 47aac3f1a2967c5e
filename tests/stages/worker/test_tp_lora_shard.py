"""A rank's shard of a packed adapter (`stages/worker/tp/lora_shard.py`), on layouts whose alignment leaves
gaps in the whole layout and in the rank's: every slice's A and B^T columns land where the rank's layout
puts them (S-LoRA's split, rebuilt here slice by slice from the layouts), the gaps are zero, and the
column runs the sharder copies by are exactly the per-column map."""

from __future__ import annotations

import pytest
import torch

from runtime.common.lora_layout import LoraLayout
from runtime.common.packed import PackedAdapter
from stages.worker.tp.lora_shard import ROW_SPLIT_GROUPS, AdapterSharder, column_runs, shard_columns

# hidden 48, 6 heads of 8 (q 48), 2 KV heads (kv 16), MLP 84: a 2-way shard's MLP of 42 and a fused
# gate/up of 84 are not multiples of the 8-element alignment, nor is the whole MLP
DIMS = dict(num_layers=3, hidden=48, q_out=48, kv_out=16, intermediate=84, max_rank=5)


def _layouts(size: int) -> tuple[LoraLayout, LoraLayout]:
    part = dict(DIMS, q_out=DIMS["q_out"] // size, kv_out=DIMS["kv_out"] // size)
    part["intermediate"] = DIMS["intermediate"] // size
    return LoraLayout.build(**DIMS), LoraLayout.build(**part)


def _reference(block: torch.Tensor, whole: LoraLayout, part: LoraLayout, rank: int) -> torch.Tensor:
    """The rank's block, slice by slice: zeros, then each slice's A rows and B^T columns of its shard."""
    out = torch.zeros((*block.shape[:2], part.row_elems), dtype=block.dtype)
    for gw in whole.groups:
        gp = part.group(gw.name)
        for s in range(gw.num_slices):
            a = block[:, :, gw.a_offset + s * gw.in_stride :][..., : gw.in_dim]
            b = block[:, :, gw.b_offset + gw.out_offsets[s] :][..., : gw.out_dims[s]]
            if gw.name in ROW_SPLIT_GROUPS:  # A by input columns, B^T whole
                a = a[..., rank * gp.in_dim : (rank + 1) * gp.in_dim]
            else:  # A whole, B^T by output columns
                b = b[..., rank * gp.out_dims[s] : (rank + 1) * gp.out_dims[s]]
            at = gp.a_offset + s * gp.in_stride
            out[:, :, at : at + gp.in_dim] = a
            at = gp.b_offset + gp.out_offsets[s]
            out[:, :, at : at + gp.out_dims[s]] = b
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_a_shard_is_each_slices_columns_with_zero_gaps(size):
    whole, part = _layouts(size)
    assert part.row_elems > sum(len(g.modules) * g.in_dim + g.out_total for g in part.groups), (
        "the rank's layout has no alignment gap to check"
    )
    g = torch.Generator().manual_seed(size)
    # nothing in the whole block is zero, its alignment gaps included: a gap of the shard that copied
    # anything would show
    block = torch.rand((DIMS["num_layers"], 4, whole.row_elems), generator=g) + 1.0
    adapter = PackedAdapter("a", block, torch.ones(3, 7, dtype=torch.int32), torch.ones(3, 7))
    for rank in range(size):
        got = AdapterSharder(whole, part, rank, size)(adapter)
        assert torch.equal(got.block, _reference(block, whole, part, rank)), rank
        assert got.ranks is adapter.ranks and got.scalings is adapter.scalings


@pytest.mark.parametrize("size", [2, 4])
def test_column_runs_spell_the_column_map(size):
    whole, part = _layouts(size)
    for rank in range(size):
        index = shard_columns(whole, part, rank, size)
        runs = column_runs(index)
        rebuilt = torch.cat(
            [torch.full((n,), -1) if first < 0 else torch.arange(first, first + n) for _, first, n in runs]
        )
        assert torch.equal(rebuilt, index)
        assert [at for at, _, _ in runs] == [0, *torch.tensor([n for *_, n in runs]).cumsum(0).tolist()[:-1]]
        for (_, f0, n0), (_, f1, _) in zip(runs, runs[1:], strict=False):  # maximal: no two could merge
            assert not (f0 < 0 and f1 < 0) and not (f0 >= 0 and f1 == f0 + n0)


def test_a_block_of_another_layout_is_refused():
    whole, part = _layouts(2)
    block = torch.zeros((3, 2, whole.row_elems + 8))
    with pytest.raises(ValueError, match="packed for another model layout"):
        AdapterSharder(whole, part, 0, 2)(PackedAdapter("x", block, torch.ones(3, 7), torch.ones(3, 7)))
