"""The shared-memory host pool: a process that attaches and exits leaves it in place, block views are
zero-copy round trips, and the worker's `packed_from_pool` rebuilds exactly the reader's PackedAdapter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proto.loader import AdapterStaged
from runtime.common.host_pool import (
    ALIGN,
    attach_pool,
    block_tensor,
    create_pool,
    dtype_name,
    packed_from_pool,
    pool_bytes_for,
    register_pinned,
    slot_load_for,
    unlink_pool,
)
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from stages.loader.adapter_reader import read_adapter

ROOT = Path(__file__).resolve().parents[3]
MAX_RANK = 16
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pool():
    shm = create_pool("lptest-", 1 << 20)
    yield shm
    unlink_pool(shm)


@pytest.fixture(scope="module")
def model(tiny_llama) -> tuple[ModelConfig, LoraLayout]:
    cfg = ModelConfig.from_dir(tiny_llama)
    return cfg, LoraLayout.for_model(cfg, MAX_RANK)


def _exists(name: str) -> bool:
    try:
        attach_pool(name).close()
    except FileNotFoundError:
        return False
    return True


def _in_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
    )


def test_a_process_that_attaches_and_exits_leaves_the_pool(pool):
    code = f"from runtime.common.host_pool import attach_pool; s = attach_pool({pool.name!r}); s.buf[5] = 42"
    child = _in_child(f"{code}; s.close()")
    assert child.returncode == 0, child.stderr
    killed = _in_child(f"import os, signal; {code}; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -9
    assert "leaked" not in child.stderr + killed.stderr
    assert pool.buf[5] == 42 and _exists(pool.name)
    again = attach_pool(pool.name)
    assert again.size == pool.size and again.buf[5] == 42
    again.close()


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="SharedMemory(track=False) exists from 3.13")
def test_the_plain_attach_would_have_removed_it():
    """What attach_pool works around: on 3.11 a plain attach unlinks the segment when the process exits."""
    shm = create_pool("lptest-", ALIGN)
    try:
        plain = f"from multiprocessing.shared_memory import SharedMemory; SharedMemory({shm.name!r})"
        child = _in_child(plain)
        assert child.returncode == 0, child.stderr
        assert not _exists(shm.name)
    finally:
        unlink_pool(shm)


def test_block_tensor_is_a_zero_copy_view(pool, model):
    _, layout = model
    rank, offset, dtype = 3, 2 * ALIGN, torch.bfloat16
    view = block_tensor(pool, offset, rank, layout, dtype)
    assert view.shape == (layout.num_layers, rank, layout.row_elems) and view.dtype == dtype
    data = torch.randn(view.shape).to(dtype)
    view.copy_(data)
    nbytes = layout.block_bytes(rank, dtype)
    assert bytes(pool.buf[offset : offset + nbytes]) == data.view(torch.uint8).flatten().numpy().tobytes()
    assert torch.equal(block_tensor(pool, offset, rank, layout, dtype), data)
    pool.buf[offset : offset + 2] = b"\0\0"  # a write through the pool shows in the view
    assert view[0, 0, 0].item() == 0.0
    del view
    with pytest.raises(ValueError, match="outside"):
        block_tensor(pool, pool.size - ALIGN, rank, layout, dtype)
    with pytest.raises(ValueError, match="rank"):
        block_tensor(pool, 0, MAX_RANK + 1, layout, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_from_pool_equals_the_readers_packed_adapter(pool, model, llama_adapters, dtype):
    cfg, layout = model
    packed = read_adapter("rs12", llama_adapters["rs12"], cfg, layout, dtype)
    offset = ALIGN
    block_tensor(pool, offset, packed.rank, layout, dtype).copy_(packed.block)
    staged = AdapterStaged(
        name="rs12",
        shm_name=pool.name,
        offset=offset,
        nbytes=packed.nbytes,
        rank=packed.rank,
        layer_nbytes=packed.nbytes // layout.num_layers,
        dtype=dtype_name(dtype),
        slice_ranks=packed.ranks.flatten().tolist(),
        slice_scalings=packed.scalings.flatten().tolist(),
    )
    load = slot_load_for(staged, slot=3, runs=[(40, 2), (7, packed.rank - 2)])
    assert (load.slot, load.adapter, load.shm_name, load.offset) == (3, "rs12", pool.name, offset)
    assert (load.row_starts, load.row_counts) == ([40, 7], [2, packed.rank - 2])
    assert not load.layered and slot_load_for(staged, slot=3, runs=[(0, packed.rank)], layered=True).layered
    worker_pool = attach_pool(pool.name)
    got = packed_from_pool(worker_pool, load, layout, dtype)
    assert got.name == "rs12" and got.rank == packed.rank == 12
    assert torch.equal(got.block, packed.block)
    assert torch.equal(got.ranks, packed.ranks) and torch.equal(got.scalings, packed.scalings)
    other = torch.float16 if dtype != torch.float16 else torch.float32
    with pytest.raises(ValueError, match="packed as"):
        packed_from_pool(worker_pool, load, layout, other)
    del got
    worker_pool.close()


def test_pool_sizing_pinning_and_a_short_dev_shm(model):
    _, layout = model
    one = layout.block_bytes(MAX_RANK, torch.bfloat16)
    size = pool_bytes_for(layout, MAX_RANK, torch.bfloat16, 3)
    assert size % ALIGN == 0 and size == 3 * ((one + ALIGN - 1) // ALIGN * ALIGN) >= 3 * one
    if not torch.cuda.is_available():
        shm = create_pool("lptest-", ALIGN)
        assert register_pinned(shm) is False
        unlink_pool(shm)
    if Path("/dev/shm").is_dir():
        with pytest.raises(OSError, match="--cpu-lora-cache-gb"):
            create_pool("lptest-", 1 << 62)
