"""Slot copies land exactly where the kernels read: a rank-r block fills rows [:r] of every layer of its
slot, leaves the rows above r and every other slot untouched, and updates the rank and scaling tables
(device and host mirror). On CUDA: the single copy (the driver's pitched copy from pinned memory below
max rank) and the layer-by-layer copy with its events, from pinned and from pageable memory, against the
source bytes."""

from __future__ import annotations

import pytest
import torch

from runtime.common.lora_layout import NUM_SLICES, LoraLayout
from runtime.common.packed import PackedAdapter
from stages.worker.lora import pitched_copy
from stages.worker.lora import slots as slots_module
from stages.worker.lora.slots import LoraSlots

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

pytestmark = pytest.mark.timeout(60)

LAYOUT = LoraLayout.build(num_layers=3, hidden=24, q_out=24, kv_out=8, intermediate=40, max_rank=8)


def _packed(rank: int, seed: int, pin: bool = False) -> PackedAdapter:
    g = torch.Generator().manual_seed(seed)
    block = torch.randn((LAYOUT.num_layers, rank, LAYOUT.row_elems), generator=g).to(torch.bfloat16)
    ranks = torch.full((LAYOUT.num_layers, NUM_SLICES), rank, dtype=torch.int32)
    ranks[1, 3] = 0  # a module this adapter does not target
    scalings = torch.rand((LAYOUT.num_layers, NUM_SLICES), generator=g)
    if pin:
        block = block.pin_memory()
    return PackedAdapter(name=f"a{rank}-{seed}", block=block, ranks=ranks, scalings=scalings)


def _check(slots: LoraSlots, slot: int, packed: PackedAdapter, before: torch.Tensor) -> None:
    mem = slots.mem.cpu()
    r = packed.rank
    assert torch.equal(mem[slot, :, :r], packed.block.cpu()), "the slot's rows differ from the block"
    assert torch.equal(mem[slot, :, r:], before[slot, :, r:]), "rows above the adapter's rank were written"
    others = [s for s in range(slots.num_slots) if s != slot]
    assert torch.equal(mem[others], before[others]), "another slot was written"
    assert torch.equal(slots.ranks[slot].cpu(), packed.ranks)
    assert torch.equal(slots.host_ranks[slot], packed.ranks)
    assert torch.equal(slots.scalings[slot].cpu(), packed.scalings)
    assert torch.equal(slots.host_scalings[slot], packed.scalings)
    assert slots.names[slot] == packed.name


def _filled_slots(device: str) -> LoraSlots:
    slots = LoraSlots(LAYOUT, 3, torch.bfloat16, torch.device(device))
    slots.mem.copy_(torch.randn(slots.mem.shape).to(torch.bfloat16))  # a previous tenant's bytes
    return slots


@pytest.mark.parametrize("rank", [1, 5, 8])
def test_copy_fills_the_rank_prefix_of_its_slot_only(rank):
    slots = _filled_slots("cpu")
    before = slots.mem.clone()
    packed = _packed(rank, seed=rank)
    assert slots.load(1, packed, layer_events=True) is None  # no events off CUDA
    _check(slots, 1, packed, before)


def test_copy_refuses_a_block_of_another_layout_or_rank():
    slots = _filled_slots("cpu")
    ok = _packed(8, seed=0)
    big = torch.cat([ok.block, ok.block[:, :1]], dim=1)  # rank 9
    with pytest.raises(ValueError, match="rank 9 > max_lora_rank 8"):
        slots.load(0, PackedAdapter("big", big, ok.ranks, ok.scalings))
    bad = _packed(4, seed=0)
    with pytest.raises(ValueError, match="another model layout or dtype"):
        slots.load(0, PackedAdapter("f32", bad.block.float(), bad.ranks, bad.scalings))


def test_pitched_copy_refuses_what_it_cannot_copy():
    src = torch.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="into"):
        pitched_copy.copy_rows(torch.zeros((2, 2, 4)), src, stream=None)
    with pytest.raises(ValueError, match="from host memory to a CUDA device"):
        pitched_copy.copy_rows(torch.zeros((2, 3, 4)), src, stream=None)


@needs_cuda
def test_pitched_copy_writes_the_rows_and_nothing_else():
    dst = torch.full((4, 6, 10), float("nan"), dtype=torch.bfloat16, device="cuda")
    src = torch.randn((4, 3, 10)).to(torch.bfloat16).pin_memory()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    assert pitched_copy.copy_rows(dst[:, :3], src, stream), "the driver's pitched copy is unavailable"
    stream.synchronize()
    assert torch.equal(dst[:, :3].cpu(), src) and dst[:, 3:].isnan().all()


@needs_cuda
@pytest.mark.parametrize("layered", [False, True], ids=["single", "layered"])
@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("rank", [3, 8])
def test_cuda_copy_on_a_side_stream(rank, pin, layered, monkeypatch):
    pitched = []

    def counting(dst, src, stream):
        pitched.append(src.shape)
        return pitched_copy.copy_rows(dst, src, stream)

    monkeypatch.setattr(slots_module, "copy_rows", counting)
    slots = _filled_slots("cuda")
    torch.cuda.synchronize()
    before = slots.mem.cpu()
    packed = _packed(rank, seed=10 + rank, pin=pin)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    events = slots.load(2, packed, stream=stream, layer_events=layered)
    if layered:
        assert events is not None and len(events) == LAYOUT.num_layers
        events[-1].synchronize()
    else:
        assert events is None
        stream.synchronize()
    _check(slots, 2, packed, before)
    # the driver's pitched copy serves exactly the single copies from pinned memory below max rank
    assert len(pitched) == int(not layered and pin and rank < LAYOUT.max_rank)
