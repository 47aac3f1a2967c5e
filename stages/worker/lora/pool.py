"""The GPU adapter pool, paged by rank: one memory block of rank rows per layer, an adapter of rank r in r
of them (anywhere, chosen by the scheduler), and per-id rank, scaling and row tables with host mirrors,
so the host plans without reading the device. Every buffer is allocated once (CUDA-graph safe).
The rows are in the model's dtype, or (`--lora-dtype fp8` / `int8`) in e4m3 / int8 with a scale per slice
of each rank row (`kernels/lora_quant.py`), quantized on the device after the host-to-device copy."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from kernels.lora_quant import NUM_SCALES, QUANT_DTYPES, quantize_rows, quantize_rows_ref, segments
from runtime.common.lora_layout import NUM_SLICES, LoraLayout
from runtime.common.packed import PackedAdapter
from stages.worker.lora.pitched_copy import copy_rows

MAX_IDS = 4096  # adapter ids at most: tables stay small (ids x max_rank x 4 bytes for the row table)
MIN_USEFUL_RANK = 4  # ids = rows // this: room for a pool full of rank-4 adapters (rank 1-3 share ids)
CPU_POOL_BYTES = 64 << 20  # the default pool off CUDA (tests, tiny models)
GPU_POOL_FRACTION = 0.10  # the default pool on CUDA: this share of free memory, before the KV cache

Runs = Sequence[tuple[int, int]]  # (first pool row, rows) per run, in rank-row order


# --lora-dtype: the pool's rows in the model's dtype ("auto"), or 8-bit with scales (`QUANT_DTYPES`)
LORA_DTYPES = ("auto", *QUANT_DTYPES)


def row_bytes(layout: LoraLayout, dtype: torch.dtype, lora_dtype: str = "auto") -> int:
    """Bytes of one rank row over all layers (what one unit of rank costs in the pool); an 8-bit
    `lora_dtype`: one byte an element and the row's fp32 scales."""
    if lora_dtype in QUANT_DTYPES:
        return layout.num_layers * (layout.row_elems + 4 * NUM_SCALES)
    return layout.num_layers * layout.row_elems * torch.empty((), dtype=dtype).element_size()


def pool_geometry(
    layout: LoraLayout, dtype: torch.dtype, nbytes: int, lora_dtype: str = "auto"
) -> tuple[int, int]:
    """(rank rows, adapter ids) of a pool of `nbytes`; it must hold one adapter of the largest rank."""
    rows = nbytes // row_bytes(layout, dtype, lora_dtype)
    if rows < layout.max_rank:
        need = layout.max_rank * row_bytes(layout, dtype, lora_dtype)
        raise ValueError(
            f"the GPU adapter pool of {nbytes} bytes holds {rows} rank rows, fewer than one adapter of "
            f"rank {layout.max_rank} ({need} bytes); raise --lora-gpu-memory-gb or lower --max-lora-rank"
        )
    return rows, max(1, min(MAX_IDS, rows // MIN_USEFUL_RANK))


def default_pool_bytes(
    layout: LoraLayout, dtype: torch.dtype, device: torch.device, lora_dtype: str = "auto"
) -> int:
    """`GPU_POOL_FRACTION` of the device's free memory (CUDA), else `CPU_POOL_BYTES`; at least one
    adapter of the largest rank."""
    floor = layout.max_rank * row_bytes(layout, dtype, lora_dtype)
    if device.type != "cuda":
        return max(CPU_POOL_BYTES, floor)
    free, _ = torch.cuda.mem_get_info(device)
    return max(int(free * GPU_POOL_FRACTION), floor)


class LoraPool:
    """`mem[num_layers, total_rows, row_elems]`; adapter id i has rank row k of every layer at pool row
    `rows[i, k]` (k < its largest rank), and per-layer ranks/scalings in `ranks[i]`/`scalings[i]`.

    The scheduler owns placement (which id, which rows) and never gives two resident adapters one row;
    the worker only checks that runs are inside the pool and add up to the rank. Rows taken by a new
    load retire the ids that held them (the scheduler evicted those adapters), so `names` says what is
    resident without a message per eviction.

    An 8-bit `lora_dtype` ("fp8": e4m3, "int8"): `mem` holds that and `scales[l, row, j]` (fp32) scales
    segment j of pool row `row` in layer l (`kernels.lora_quant.segments`); an adapter block (in `dtype`,
    as the host cache holds it) goes whole into a device staging buffer of one largest-rank adapter, then
    is quantized into its rows."""

    def __init__(
        self,
        layout: LoraLayout,
        total_rows: int,
        num_ids: int,
        dtype: torch.dtype,
        device: torch.device,
        lora_dtype: str = "auto",
    ):
        self.layout = layout
        self.total_rows = total_rows
        self.num_ids = num_ids
        self.dtype = dtype  # of the adapter blocks it loads (the model's)
        self.device = device
        if lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {lora_dtype!r}")
        self.quantized = lora_dtype in QUANT_DTYPES
        self.row_nbytes = row_bytes(layout, dtype, lora_dtype)  # one rank row over all layers
        L, R = layout.num_layers, layout.max_rank
        row_dtype = QUANT_DTYPES.get(lora_dtype, dtype)
        self.mem = torch.zeros((L, total_rows, layout.row_elems), dtype=row_dtype, device=device)
        self.scales = None
        if self.quantized:
            self.scales = torch.zeros((L, total_rows, NUM_SCALES), dtype=torch.float32, device=device)
            self._segments = segments(layout)
            self._segs = torch.tensor(self._segments, dtype=torch.int32, device=device)  # [NUM_SCALES, 2]
            self._staging = torch.empty(L * R * layout.row_elems, dtype=dtype, device=device)
            self._staging_free: torch.cuda.Event | None = None  # the last quantization read it
        self.ranks = torch.zeros((num_ids, L, NUM_SLICES), dtype=torch.int32, device=device)  # 0: unused
        self.scalings = torch.zeros((num_ids, L, NUM_SLICES), dtype=torch.float32, device=device)
        self.rows = torch.zeros((num_ids, R), dtype=torch.int32, device=device)  # [num_ids, max_rank]
        self.host_ranks = torch.zeros_like(self.ranks, device="cpu")
        self.host_scalings = torch.zeros_like(self.scalings, device="cpu")
        self.host_rows = torch.zeros_like(self.rows, device="cpu")
        self.names: list[str | None] = [None] * num_ids
        self._owner = np.full(total_rows, -1, dtype=np.int32)  # [total_rows] id holding each row
        self._held: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # sources of pitched copies in flight
        if device.type == "cuda":
            # pinned staging of each id's tables: copied without waiting on anything, reused once the id's
            # previous table copy is done (a fresh pin per load cost more host time than a copy)
            self._stage_ranks = torch.empty_like(self.host_ranks).pin_memory()
            self._stage_scalings = torch.empty_like(self.host_scalings).pin_memory()
            self._stage_rows = torch.empty_like(self.host_rows).pin_memory()
            self._staged: list[torch.cuda.Event | None] = [None] * num_ids
        if self.quantized and device.type == "cuda":  # compile the quantization now, not at a first load
            zeros = self._staging[: L * layout.row_elems].view(L, 1, layout.row_elems).zero_()
            self._quantize(zeros, slice(0, L), 0, self.host_rows[0, :1])  # into row 0, free until a load

    @property
    def num_slots(self) -> int:
        """Adapter ids (the kernels' and batch metadata's name for them)."""
        return self.num_ids

    def resident(self) -> int:
        return sum(n is not None for n in self.names)

    def load(
        self,
        lora_id: int,
        adapter: PackedAdapter,
        runs: Runs,
        stream: torch.cuda.Stream | None = None,
        layer_events: bool = False,
    ) -> list[torch.cuda.Event] | None:
        """Copy a packed adapter into the pool rows of `runs` and its tables into id `lora_id` (on
        `stream` when given); the caller orders later reads after this copy. With `layer_events` (CUDA)
        the tables go first, then each layer's rows in order, and the caller gets one event per layer, so
        layer i may compute while later layers still copy. Without, one copy per run (a pitched DMA from
        pinned memory), since per-layer copies of a small block cost more in launches than its transfer."""
        rank_rows = self._check(lora_id, adapter, runs)
        cuda = self.device.type == "cuda"
        pinned = adapter.block.is_pinned()
        events = [] if layer_events and cuda else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if self.quantized:
                self._load_quantized(lora_id, adapter, rank_rows, events)
            elif events is None:  # the block first, so its DMA starts while the tables are issued
                k = 0
                for start, n in runs:
                    src = adapter.block[:, k : k + n]  # [L, n, row_elems], rows of one layer contiguous
                    dst = self.mem[:, start : start + n]
                    if not (cuda and pinned and self._pitched(dst, src)):
                        dst.copy_(src, non_blocking=pinned)
                    k += n
                self._copy_tables(lora_id, adapter, rank_rows)
            else:  # the tables first: layer 0 may run once its own rows are in
                self._copy_tables(lora_id, adapter, rank_rows)
                for layer in range(self.layout.num_layers):
                    k = 0
                    for start, n in runs:
                        self.mem[layer, start : start + n].copy_(
                            adapter.block[layer, k : k + n], non_blocking=pinned
                        )
                        k += n
                    events.append(torch.cuda.Event())
                    events[-1].record()
        self._retire(rank_rows, lora_id)
        self.host_ranks[lora_id] = adapter.ranks
        self.host_scalings[lora_id] = adapter.scalings
        self.host_rows[lora_id, : adapter.rank] = rank_rows
        self.names[lora_id] = adapter.name
        return events

    def _load_quantized(
        self, lora_id: int, adapter: PackedAdapter, rank_rows: torch.Tensor, events: list | None
    ) -> None:
        """The block into the staging buffer (one copy, or one a layer with `events`), the tables, then
        each layer's rank rows quantized into their pool rows; the quantization reads the row table's
        device copy, written just before on this stream."""
        L, r, E = adapter.block.shape
        cuda = self.device.type == "cuda"
        pinned = adapter.block.is_pinned()
        stage = self._staging[: L * r * E].view(L, r, E)
        if cuda and self._staging_free is not None:
            torch.cuda.current_stream(self.device).wait_event(self._staging_free)  # the last load's reads
        if events is None:
            stage.copy_(adapter.block, non_blocking=pinned)
            self._copy_tables(lora_id, adapter, rank_rows)
            self._quantize(stage, slice(0, L), lora_id, rank_rows)
        else:
            self._copy_tables(lora_id, adapter, rank_rows)
            for layer in range(L):
                stage[layer].copy_(adapter.block[layer], non_blocking=pinned)
                self._quantize(stage[layer : layer + 1], slice(layer, layer + 1), lora_id, rank_rows)
                events.append(torch.cuda.Event())
                events[-1].record()
        if cuda:
            self._staging_free = torch.cuda.Event()
            self._staging_free.record()
            if pinned:  # the block must outlive its copy (as `_pitched` holds it)
                self._held = [(e, t) for e, t in self._held if not e.query()]
                self._held.append((self._staging_free, adapter.block))

    def _quantize(self, src: torch.Tensor, layers: slice, lora_id: int, rank_rows: torch.Tensor) -> None:
        r = src.shape[1]
        if self.device.type == "cuda":
            rows = self.rows[lora_id, :r]
            quantize_rows(src, self.mem[layers], self.scales[layers], rows, self._segs, check=False)
        else:  # the CPU pool: the same function in torch (the interpreter's e4m3 rounding is not RNE)
            q, scales = quantize_rows_ref(src, self._segments, self.mem.dtype)
            index = rank_rows.long()
            mem, bits, sc = self.mem[layers].view(torch.uint8), q.view(torch.uint8), self.scales[layers]
            for j, (off, n) in enumerate(self._segments):
                mem[:, index, off : off + n] = bits[..., off : off + n]
                sc[:, index, j] = scales[..., j]

    def _check(self, lora_id: int, adapter: PackedAdapter, runs: Runs) -> torch.Tensor:
        """The adapter's pool rows in rank order ([rank] int32), after checking the load is well formed."""
        if adapter.rank > self.layout.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r}: rank {adapter.rank} > max_lora_rank {self.layout.max_rank}"
            )
        if adapter.block.dtype != self.dtype or adapter.block.shape[2] != self.layout.row_elems:
            raise ValueError(f"adapter {adapter.name!r} was packed for another model layout or dtype")
        if not 0 <= lora_id < self.num_ids:
            raise ValueError(f"adapter id {lora_id} outside 0..{self.num_ids - 1}")
        if any(n <= 0 or start < 0 or start + n > self.total_rows for start, n in runs):
            raise ValueError(
                f"adapter {adapter.name!r}: row runs {list(runs)} outside the {self.total_rows}-row pool"
            )
        rows = torch.cat([torch.arange(s, s + n, dtype=torch.int32) for s, n in runs]) if runs else None
        if rows is None or rows.numel() != adapter.rank:
            raise ValueError(
                f"adapter {adapter.name!r}: row runs {list(runs)} do not hold rank {adapter.rank}"
            )
        return rows

    def _retire(self, rows: torch.Tensor, lora_id: int) -> None:
        """Ids whose rows this load takes (and `lora_id`'s old rows) are no longer resident."""
        self._owner[self._owner == lora_id] = -1
        index = rows.numpy()
        for old in np.unique(self._owner[index]):
            if old >= 0:
                self._owner[self._owner == old] = -1
                self.names[old] = None
                self.host_ranks[old].zero_()  # the host mirror only: the scheduler no longer uses `old`
        self._owner[index] = lora_id

    def _copy_tables(self, lora_id: int, adapter: PackedAdapter, rank_rows: torch.Tensor) -> None:
        """Ranks, scalings and rows into the id's device tables (on the current stream); on CUDA through
        the id's pinned staging, since a copy from pageable memory may wait for the stream's earlier work."""
        r = adapter.rank
        if self.device.type != "cuda":
            self.ranks[lora_id].copy_(adapter.ranks)
            self.scalings[lora_id].copy_(adapter.scalings)
            self.rows[lora_id, :r].copy_(rank_rows)
            return
        previous = self._staged[lora_id]
        if previous is not None:
            previous.synchronize()  # the staging rows' last copy (long done unless loads come back to back)
        self._stage_ranks[lora_id].copy_(adapter.ranks)
        self._stage_scalings[lora_id].copy_(adapter.scalings)
        self._stage_rows[lora_id, :r].copy_(rank_rows)
        self.ranks[lora_id].copy_(self._stage_ranks[lora_id], non_blocking=True)
        self.scalings[lora_id].copy_(self._stage_scalings[lora_id], non_blocking=True)
        self.rows[lora_id, :r].copy_(self._stage_rows[lora_id, :r], non_blocking=True)
        done = self._staged[lora_id] = torch.cuda.Event()
        done.record()

    def _pitched(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """One pitched DMA of a run of rows of every layer, on the current stream; the block is held until
        that copy completed (a caching host allocator may reuse it otherwise)."""
        self._held = [(e, t) for e, t in self._held if not e.query()]
        stream = torch.cuda.current_stream(self.device)
        if not copy_rows(dst, src, stream):
            return False
        done = torch.cuda.Event()
        done.record(stream)
        self._held.append((done, src))
        return True

    def clear(self, lora_id: int) -> None:
        """Mark an id empty (unload, failed load). Its rows are left as they are: rank 0 makes every kernel
        skip the id, and the scheduler hands the rows to others."""
        self.ranks[lora_id].zero_()
        self.host_ranks[lora_id].zero_()
        self._owner[self._owner == lora_id] = -1
        self.names[lora_id] = None


def runs_of(starts: Sequence[int], counts: Sequence[int]) -> list[tuple[int, int]]:
    """A SlotLoad's row runs as (start, rows) pairs."""
    if len(starts) != len(counts):
        raise ValueError(f"{len(starts)} row starts but {len(counts)} row counts")
    return list(zip(starts, counts, strict=True))
