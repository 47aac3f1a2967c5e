"""What one adapter load will do, worked out from the safetensors header and adapter_config.json before a
byte of tensor data is read: every tensor's destination in the packed block, the file cut into chunks
that threads can read and pack independently, and the block regions no tensor covers (zeroed)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from runtime.common.lora_layout import TARGET_MODULES, LoraLayout
from stages.loader.safetensors_reader import ITEM_SIZES, TensorEntry


@dataclass(frozen=True)
class ReadLimits:
    """Bounds on one adapter read: the tensor file's size, the time from open to the last byte, and the
    bytes one read covers (a chunk: the unit a thread reads and packs)."""

    max_file_bytes: int = 8 << 30
    timeout_s: float = 120.0
    chunk_bytes: int = 4 << 20


class Piece(NamedTuple):  # a tuple: hundreds are made per adapter, under the GIL
    """One tensor's move: lora_A [r, in] to rows :r at `col`, or lora_B [out, r] transposed there."""

    entry: TensorEntry
    layer: int
    module: str
    col: int
    width: int  # in_dim (A) or the slice's out dim (B)
    rank: int
    transpose: bool  # lora_B


@dataclass(frozen=True)
class Run:
    """Tensors of one kind (module, A or B, dtype, shape) evenly spaced both in the file (`step` bytes)
    and in the block's layers (`layer_step`): moved by one strided copy. `aligned`: every tensor starts
    at a multiple of its item size (the format does not promise it; unaligned ones go one by one)."""

    pieces: tuple[Piece, ...]
    step: int
    layer_step: int
    aligned: bool


@dataclass(frozen=True)
class Chunk:
    """Consecutive tensors of the file, read with one positioned read of bytes [start, end). `dtype`:
    the one dtype of all its tensors, if so (one value check covers the whole chunk)."""

    start: int
    end: int
    pieces: tuple[Piece, ...]
    runs: tuple[Run, ...]
    dtype: str | None


@dataclass(frozen=True)
class Gap:
    """Block region no tensor writes: rows [row0, row1) x columns [col0, col1) of `layer` (None: all)."""

    layer: int | None
    row0: int
    row1: int
    col0: int
    col1: int


@dataclass
class AdapterPlan:
    """A validated adapter, its file still open (`close()` it; also a context manager). `parts`: 0 is
    the gap zeroing, i >= 1 is chunk i - 1; parts touch disjoint bytes of the block, in any order."""

    name: str
    fd: int
    dtype: torch.dtype  # the block's (the model's) dtype
    rank: int
    num_layers: int
    row_elems: int
    ranks: torch.Tensor  # [num_layers, NUM_SLICES] int32, 0 where the adapter has no tensor
    scalings: torch.Tensor  # [num_layers, NUM_SLICES] float32
    chunks: list[Chunk]
    gaps: list[Gap]
    deadline: float  # time.monotonic() after which reads fail
    file_bytes: int
    closed: bool = field(default=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.rank, self.row_elems)  # [num_layers, rank, row_elems]

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.rank * self.row_elems * self.dtype.itemsize

    @property
    def num_parts(self) -> int:
        return 1 + len(self.chunks)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)

    def __enter__(self) -> AdapterPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_chunks(pieces: list[Piece], chunk_bytes: int) -> list[Chunk]:
    """Pieces in file order, cut at layer boundaries into chunks of at most `chunk_bytes` whose layers
    follow each other (so each kind of tensor makes one run in a chunk); a layer larger than a chunk is cut
    between tensors. The header check guarantees the tensors tile the data section, so a chunk is one
    byte range."""
    ordered = sorted(pieces, key=lambda p: p.entry.start)
    groups: list[list[Piece]] = []  # maximal stretches of one layer
    for p in ordered:
        if groups and groups[-1][-1].layer == p.layer:
            groups[-1].append(p)
        else:
            groups.append([p])
    spans: list[list[Piece]] = []
    for g in groups:
        size = g[-1].entry.end - g[0].entry.start
        last = spans[-1] if spans else None
        if last and last[-1].layer + 1 == g[0].layer and g[-1].entry.end - last[0].entry.start <= chunk_bytes:
            last += g
        elif size <= chunk_bytes:
            spans.append(list(g))
        else:
            for p in g:  # by size, between tensors
                if (
                    spans
                    and spans[-1][-1].layer == p.layer
                    and p.entry.end - spans[-1][0].entry.start <= chunk_bytes
                ):
                    spans[-1].append(p)
                else:
                    spans.append([p])
    return [_chunk(span) for span in spans]


def _chunk(span: list[Piece]) -> Chunk:
    dtypes = {p.entry.dtype for p in span}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return Chunk(span[0].entry.start, span[-1].entry.end, tuple(span), _runs(span), dtype)


def _runs(span: list[Piece]) -> tuple[Run, ...]:
    """The span's pieces grouped into runs: one kind, a constant file step, a constant positive layer step."""
    kinds: dict[tuple, list[Piece]] = {}
    for p in span:
        kinds.setdefault((p.module, p.transpose, p.entry.dtype, p.entry.shape), []).append(p)
    runs: list[Run] = []
    for same in kinds.values():
        run: list[Piece] = []
        for p in same:
            size = ITEM_SIZES[p.entry.dtype]
            if p.entry.start % size:
                runs.append(Run((p,), 0, 0, aligned=False))
                continue
            if len(run) >= 2 and (
                p.entry.start - run[-1].entry.start != run[1].entry.start - run[0].entry.start
                or p.layer - run[-1].layer != run[1].layer - run[0].layer
            ):
                runs.append(_run(run))
                run = []
            if len(run) == 1 and p.layer <= run[0].layer:
                runs.append(_run(run))
                run = []
            run.append(p)
        if run:
            runs.append(_run(run))
    return tuple(runs)


def _run(pieces: list[Piece]) -> Run:
    if len(pieces) == 1:
        return Run((pieces[0],), 0, 0, aligned=True)
    step = pieces[1].entry.start - pieces[0].entry.start
    return Run(tuple(pieces), step, pieces[1].layer - pieces[0].layer, aligned=True)


def make_gaps(layout: LoraLayout, rank: int, ranks: list[list[int]]) -> list[Gap]:
    """The rows each slice's columns get no data for (rank below the block's, or no tensor at all) and
    the alignment padding between slices, so a reused pool block holds no stale bytes."""
    gaps: list[Gap] = []
    covered: list[tuple[int, int]] = []
    for g in layout.groups:
        for s, module in enumerate(g.modules):
            sid = TARGET_MODULES.index(module)
            written = [layer[sid] for layer in ranks]  # rows per layer
            a_col, b_col = g.a_offset + s * g.in_stride, g.b_offset + g.out_offsets[s]
            for col, width in ((a_col, g.in_dim), (b_col, g.out_dims[s])):
                covered.append((col, col + width))
                if len(set(written)) == 1:
                    if written[0] < rank:
                        gaps.append(Gap(None, written[0], rank, col, col + width))
                    continue
                gaps += [Gap(i, r, rank, col, col + width) for i, r in enumerate(written) if r < rank]
    cursor = 0
    for start, end in sorted(covered):
        if start > cursor:
            gaps.append(Gap(None, 0, rank, cursor, start))
        cursor = max(cursor, end)
    if cursor < layout.row_elems:
        gaps.append(Gap(None, 0, rank, cursor, layout.row_elems))
    return gaps


def deadline_after(limits: ReadLimits) -> float:
    return time.monotonic() + limits.timeout_s
