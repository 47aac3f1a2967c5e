"""Pool copies land exactly where the kernels read: a rank-r block fills the r pool rows of its runs (in
rank order) in every layer, leaves every other row untouched, and updates the id's rank, scaling and row
tables (device and host mirror). On CUDA: the single copy (one pitched driver copy per run from pinned
memory) and the layer-by-layer copy with its events, from pinned and from pageable memory, against the
source bytes."""

from __future__ import annotations

import pytest
import torch

from runtime.common.lora_layout import NUM_SLICES, LoraLayout
from runtime.common.packed import PackedAdapter
from stages.worker.lora import pitched_copy
from stages.worker.lora import pool as pool_module
from stages.worker.lora.pool import LoraPool

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


RUNS = [(9, 2), (0, 3), (5, 3)]  # rank rows 0-1 at pool rows 9-10, 2-4 at 0-2, 5-7 at 5-7


def _runs(rank: int) -> list[tuple[int, int]]:
    out, left = [], rank
    for start, n in RUNS:
        if left:
            out.append((start, min(n, left)))
            left -= out[-1][1]
    return out


def _check(pool: LoraPool, lora_id: int, packed: PackedAdapter, runs, before: torch.Tensor) -> None:
    mem = pool.mem.cpu()  # [L, rows, row]
    rows = [s + k for s, n in runs for k in range(n)]
    assert torch.equal(mem[:, rows], packed.block.cpu()), "the adapter's rows differ from the block"
    others = [r for r in range(pool.total_rows) if r not in rows]
    assert torch.equal(mem[:, others], before[:, others]), "a row outside the adapter's runs was written"
    assert pool.host_rows[lora_id, : packed.rank].tolist() == rows
    assert pool.rows[lora_id, : packed.rank].cpu().tolist() == rows
    assert torch.equal(pool.ranks[lora_id].cpu(), packed.ranks)
    assert torch.equal(pool.host_ranks[lora_id], packed.ranks)
    assert torch.equal(pool.scalings[lora_id].cpu(), packed.scalings)
    assert torch.equal(pool.host_scalings[lora_id], packed.scalings)
    assert pool.names[lora_id] == packed.name


def _filled_pool(device: str) -> LoraPool:
    pool = LoraPool(LAYOUT, 12, 3, torch.bfloat16, torch.device(device))
    pool.mem.copy_(torch.randn(pool.mem.shape).to(torch.bfloat16))  # a previous tenant's bytes
    return pool


@pytest.mark.parametrize("rank", [1, 5, 8])
def test_copy_fills_the_runs_of_its_adapter_only(rank):
    pool = _filled_pool("cpu")
    before = pool.mem.clone()
    packed = _packed(rank, seed=rank)
    assert pool.load(1, packed, _runs(rank), layer_events=True) is None  # no events off CUDA
    _check(pool, 1, packed, _runs(rank), before)


def test_a_load_over_another_ids_rows_retires_that_id():
    pool = _filled_pool("cpu")
    pool.load(0, _packed(3, seed=1), [(0, 3)])
    pool.load(1, _packed(2, seed=2), [(3, 2)])
    pool.load(2, _packed(4, seed=3), [(2, 1), (5, 3)])  # takes row 2 of id 0 (evicted by the scheduler)
    assert pool.names[0] is None and pool.host_ranks[0].sum() == 0 and pool.names[1] is not None
    assert pool.resident() == 2


def test_copy_refuses_a_block_of_another_layout_rank_or_rows():
    pool = _filled_pool("cpu")
    ok = _packed(8, seed=0)
    big = torch.cat([ok.block, ok.block[:, :1]], dim=1)  # rank 9
    with pytest.raises(ValueError, match="rank 9 > max_lora_rank 8"):
        pool.load(0, PackedAdapter("big", big, ok.ranks, ok.scalings), [(0, 9)])
    bad = _packed(4, seed=0)
    with pytest.raises(ValueError, match="another model layout or dtype"):
        pool.load(0, PackedAdapter("f32", bad.block.float(), bad.ranks, bad.scalings), [(0, 4)])
    with pytest.raises(ValueError, match="outside the 12-row pool"):
        pool.load(0, bad, [(10, 4)])
    with pytest.raises(ValueError, match="do not hold rank 4"):
        pool.load(0, bad, [(0, 3)])
    with pytest.raises(ValueError, match="adapter id 3"):
        pool.load(3, bad, [(0, 4)])


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

    monkeypatch.setattr(pool_module, "copy_rows", counting)
    pool = _filled_pool("cuda")
    torch.cuda.synchronize()
    before = pool.mem.cpu()
    packed = _packed(rank, seed=10 + rank, pin=pin)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    events = pool.load(2, packed, _runs(rank), stream=stream, layer_events=layered)
    if layered:
        assert events is not None and len(events) == LAYOUT.num_layers
        events[-1].synchronize()
    else:
        assert events is None
        stream.synchronize()
    _check(pool, 2, packed, _runs(rank), before)
    # the driver's pitched copy serves exactly the single copies from pinned memory, one per run
    assert len(pitched) == (len(_runs(rank)) if not layered and pin else 0)
