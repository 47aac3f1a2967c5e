"""A rank's shard of a packed adapter cut on the GPU (`AdapterSharder` with a CUDA device): the same
elements as the slice-by-slice reference, the alignment gaps zero, for adapters of several ranks back to
back from pinned and pageable blocks, on the current stream and on a side stream as the server's load
stream does; and a pool loaded from the device shard holds the reference's rows."""

from __future__ import annotations

import pytest
import torch

from runtime.common.packed import PackedAdapter
from stages.worker.lora.pool import LoraPool
from stages.worker.tp.lora_shard import AdapterSharder
from tests.stages.worker.test_tp_lora_shard import DIMS, _layouts, _reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEVICE = torch.device("cuda")


def _adapter(whole, rank: int, seed: int, dtype: torch.dtype, pinned: bool) -> PackedAdapter:
    g = torch.Generator().manual_seed(seed)
    block = (torch.rand((DIMS["num_layers"], rank, whole.row_elems), generator=g) + 1.0).to(dtype)
    block = block.pin_memory() if pinned else block
    ranks = torch.full((DIMS["num_layers"], 7), rank, dtype=torch.int32)
    return PackedAdapter(f"a{seed}", block, ranks, torch.ones(DIMS["num_layers"], 7))


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_shards_equal_the_reference_on_either_stream(size, dtype):
    whole, part = _layouts(size)
    side = torch.cuda.Stream()
    for rank in range(size):
        sharder = AdapterSharder(whole, part, rank, size, DEVICE, dtype)
        for i, r in enumerate((DIMS["max_rank"], 1, 3, DIMS["max_rank"])):
            adapter = _adapter(whole, r, 10 * rank + i, dtype, pinned=i != 2)
            stream = side if i % 2 else None
            got = sharder(adapter, stream)
            assert got.block.device.type == "cuda" and got.block.shape == (
                DIMS["num_layers"],
                r,
                part.row_elems,
            )
            if stream is not None:  # read after the stream that cut it
                torch.cuda.current_stream().wait_stream(stream)
            host = got.block.cpu()
            assert torch.equal(host, _reference(adapter.block, whole, part, rank)), (rank, r)


def test_a_pool_loaded_from_a_device_shard_holds_its_rows():
    whole, part = _layouts(2)
    pool = LoraPool(part, total_rows=12, num_ids=3, dtype=torch.bfloat16, device=DEVICE)
    sharder = AdapterSharder(whole, part, 1, 2, DEVICE, torch.bfloat16)
    first = _adapter(whole, 4, 1, torch.bfloat16, pinned=True)
    second = _adapter(whole, 5, 2, torch.bfloat16, pinned=True)
    pool.load(0, sharder(first), [(7, 2), (0, 2)])
    pool.load(1, sharder(second), [(2, 5)])  # the sharder's buffers are reused: the first copy is done
    torch.cuda.synchronize()
    mem = pool.mem.cpu()
    want = _reference(first.block, whole, part, 1)
    assert torch.equal(mem[:, 7:9], want[:, :2]) and torch.equal(mem[:, 0:2], want[:, 2:4])
    assert torch.equal(mem[:, 2:7], _reference(second.block, whole, part, 1))


def test_a_rank_above_the_staging_is_refused_by_name():
    whole, part = _layouts(2)
    sharder = AdapterSharder(whole, part, 0, 2, DEVICE, torch.float32)
    with pytest.raises(ValueError, match=r"adapter 'a0': rank 6 > max_lora_rank 5"):
        sharder(_adapter(whole, DIMS["max_rank"] + 1, 0, torch.float32, pinned=False))
