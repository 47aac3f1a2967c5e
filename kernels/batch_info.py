"""Per-forward LoRA batch metadata for the SGMV kernels: token tiles (start, end, slot) planned on the host,
written into a pinned ring buffer and uploaded by one small kernel (kernels/host_copy) into a fixed device
buffer."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.host_copy import PinnedBuffer

# Header row: [num_tiles, num_tokens, max_len, block_m]. Row 1 + i: tile i's [start, end, slot] and, in
# column 3, the adapter id of rows [i * ACT_BLOCK_M, (i + 1) * ACT_BLOCK_M) when they all have that one
# adapter, else -1 (rows of several adapters, or without one): see kernels/lora_expand_act.py.
META_COLS = 4
MIN_BLOCK = 16  # smallest tl.dot dimension
ACT_BLOCK_M = 16  # rows per block of column 3


@functools.cache
def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1). Read once: triton
    itself decides at import, and this is asked on every kernel launch."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_rank_for(max_rank: int) -> int:
    """Rank tile of the kernels: a power of two >= 16 covering the batch's largest real rank."""
    return max(MIN_BLOCK, next_pow2(max_rank))


def choose_block_m(max_len: int, num_tokens: int) -> int:
    """Token tile: 16 (many small tiles, so little split-K is needed) unless the batch is prefill-sized
    with long runs, where a wide tile cuts the re-reads of each adapter's A and B."""
    if num_tokens >= 512 and max_len >= 128:
        return 64
    return 16


@dataclass(frozen=True)
class BatchInfo:
    """Host-known sizes of one forward plus the device metadata the kernels read.

    `meta` is device int32 `[1 + capacity, META_COLS]`: row 0 the header, row 1+i tile i. Grids are
    sized from the host fields only; kernels also stop at the device header's tile count, so a grid
    padded to capacity (CUDA graph capture) stays correct."""

    meta: torch.Tensor = field(repr=False)
    num_tokens: int  # T, all tokens of the forward (base-only ones included)
    num_tiles: int  # tiles of at most block_m tokens of one slot; base-only tokens have none
    block_m: int
    max_len: int  # longest run of tokens sharing one slot
    block_rank: int  # power of two >= every real rank of the batch's slots
    num_slots_used: int  # distinct adapter slots in the batch
    row_blocks: int = 0  # blocks of ACT_BLOCK_M rows whose adapter id column 3 holds


def plan_runs(seg_indptr: Sequence[int], seg_slots: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Adapter runs (start, end, slot) as int64 arrays: adjacent segments of one slot merged, slot -1
    and empty segments dropped."""
    ind = np.asarray(seg_indptr, dtype=np.int64)
    slots = np.asarray(seg_slots, dtype=np.int64)
    if ind.shape[0] != slots.shape[0] + 1:
        raise ValueError(f"seg_indptr has {ind.shape[0]} entries, expected len(seg_slots) + 1")
    starts, ends = ind[:-1], ind[1:]
    if np.any(ends < starts):
        raise ValueError("seg_indptr must be non-decreasing")
    keep = (slots >= 0) & (ends > starts)
    starts, ends, slots = starts[keep], ends[keep], slots[keep]
    if starts.size == 0:
        return starts, ends, slots
    brk = np.ones(starts.size, dtype=bool)  # a new run starts where the slot changes or tokens jump
    brk[1:] = (slots[1:] != slots[:-1]) | (starts[1:] != ends[:-1])
    last = np.append(brk[1:], True)
    return starts[brk], ends[last], slots[brk]


def plan_tiles(runs: tuple[np.ndarray, ...], block_m: int) -> np.ndarray:
    """Split each run into tiles of at most `block_m` tokens: int32 [n, META_COLS] (start, end, slot, 0)."""
    run_start, run_end, run_slot = runs
    ntile = (run_end - run_start + block_m - 1) // block_m
    tile_run = np.repeat(np.arange(run_start.size), ntile)
    within = np.arange(tile_run.size) - np.repeat(np.cumsum(ntile) - ntile, ntile)
    tiles = np.zeros((tile_run.size, META_COLS), dtype=np.int32)  # [n, META_COLS]
    tiles[:, 0] = run_start[tile_run] + within * block_m
    tiles[:, 1] = np.minimum(tiles[:, 0] + block_m, run_end[tile_run])
    tiles[:, 2] = run_slot[tile_run]
    return tiles


def block_slots(runs: tuple[np.ndarray, ...], cover: int) -> np.ndarray:
    """Per block of ACT_BLOCK_M rows of `cover`: the adapter id all its rows have, else -1 (int32)."""
    blocks = -(-cover // ACT_BLOCK_M)
    row = np.full(blocks * ACT_BLOCK_M, -1, dtype=np.int64)
    start, end, slot = runs
    length = end - start
    first = np.repeat(start - np.cumsum(length) + length, length)  # each run row's offset into its run
    row[first + np.arange(int(length.sum()))] = np.repeat(slot, length)
    row[cover:] = row[cover - 1] if cover else -1  # rows past `cover` do not exist: no say in the block
    per = row.reshape(blocks, ACT_BLOCK_M)
    lo, hi = per.min(axis=1), per.max(axis=1)
    return np.where((lo == hi) & (lo >= 0), lo, -1).astype(np.int32)


class BatchInfoBuilder:
    """Owns the fixed device metadata buffer (allocated once, so graph capture can reuse its address)
    and a small ring of host staging buffers (pinned on CUDA) so that a new forward never overwrites a
    buffer whose copy may still be in flight."""

    def __init__(self, max_tokens: int, device: torch.device | str, ring: int = 4):
        self.device = torch.device(device)
        self.capacity = max(1, max_tokens)  # a tile holds >= 1 token, so tiles <= tokens
        cuda = self.device.type == "cuda"
        self._host = [PinnedBuffer((1 + self.capacity) * META_COLS, torch.int32, cuda) for _ in range(ring)]
        self._next = 0
        # [1 + capacity, META_COLS] int32, fixed for the builder's lifetime
        self.meta = torch.zeros((1 + self.capacity, META_COLS), dtype=torch.int32, device=self.device)

    def build(
        self,
        seg_indptr: Sequence[int],
        seg_slots: Sequence[int],
        max_rank: int,
        block_m: int | None = None,
        cover: int | None = None,
    ) -> BatchInfo:
        """Plan the tiles on the host and issue the one upload to the device (no device reads). `cover`:
        the rows the forward runs (padding included; default the batch's tokens), whose blocks get their
        one adapter id (or -1) in column 3."""
        num_tokens = int(seg_indptr[-1]) if len(seg_indptr) else 0
        cover = num_tokens if cover is None else cover
        if max(num_tokens, cover) > self.capacity:
            raise ValueError(
                f"batch has {max(num_tokens, cover)} tokens, more than max_tokens={self.capacity}"
            )
        runs = plan_runs(seg_indptr, seg_slots)
        max_len = int((runs[1] - runs[0]).max()) if runs[0].size else 0
        block_m = block_m or choose_block_m(max_len, num_tokens)
        tiles = plan_tiles(runs, block_m)
        n = tiles.shape[0]
        blocks = -(-cover // ACT_BLOCK_M)
        i = self._next
        self._next = (i + 1) % len(self._host)
        buf = self._host[i]
        buf.wait_free()
        arr = buf.host.numpy().reshape(1 + self.capacity, META_COLS)
        arr[0] = (n, num_tokens, max_len, block_m)
        arr[1 : 1 + n] = tiles
        arr[1 : 1 + blocks, 3] = block_slots(runs, cover)
        used = 1 + max(n, blocks)
        buf.upload(self.meta[:used].view(-1), used * META_COLS)
        return BatchInfo(
            meta=self.meta,
            num_tokens=num_tokens,
            num_tiles=n,
            block_m=block_m,
            max_len=max_len,
            block_rank=block_rank_for(max_rank),
            num_slots_used=int(np.unique(runs[2]).size),
            row_blocks=blocks,
        )


def read_tiles(info: BatchInfo) -> list[tuple[int, int, int]]:
    """(start, end, slot) of every tile, read back from the device: for references and tests only."""
    rows = info.meta[1 : 1 + info.num_tiles].cpu().tolist()
    return [(r[0], r[1], r[2]) for r in rows]
