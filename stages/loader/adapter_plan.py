"""What one adapter load will do, worked out from the safetensors header and adapter_config.json before a
byte of tensor data is read: every tensor's destination in the packed block, grouped into segments of
the file (read in parallel ranges, then packed by parallel tasks of strided runs), and the block regions
no tensor covers (zeroed)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proto.loader_parts import Gap, Part, Piece
from runtime.common.lora_layout import TARGET_MODULES, LoraLayout

if TYPE_CHECKING:  # the plan's checks (adapter_check.py) run without torch
    import torch


@dataclass(frozen=True)
class ReadLimits:
    """Bounds on one adapter read and how it is cut: the tensor file's size, the time from open to the
    last byte; a segment (the bytes held in memory at once: most adapters are one), and its parts (one
    task each, run in parallel: at most `tasks` of them, the threads that will run them, each at least
    `min_part_bytes` and at most `read_bytes`, one thread's positioned read, unless one tensor is more)."""

    max_file_bytes: int = 8 << 30
    timeout_s: float = 120.0
    segment_bytes: int = 256 << 20
    read_bytes: int = 16 << 20
    tasks: int = 8
    min_part_bytes: int = 1 << 20


@dataclass(frozen=True)
class Segment:
    """Consecutive whole layers of the file, bytes [start, end), held in one buffer and cut into `parts`
    that run in parallel."""

    start: int
    end: int
    pieces: tuple[Piece, ...]
    parts: tuple[Part, ...]


@dataclass
class AdapterPlan:
    """A validated adapter, its file still open (`close()` it; also a context manager). Segment after
    segment (they share one buffer), each segment's parts in any order on any threads; the gap zeroing
    may run at any time. Parts and gaps touch disjoint bytes of the block."""

    name: str
    fd: int
    dtype: torch.dtype  # the block's (the model's) dtype
    rank: int
    num_layers: int
    row_elems: int
    ranks: torch.Tensor  # [num_layers, NUM_SLICES] int32, 0 where the adapter has no tensor
    scalings: torch.Tensor  # [num_layers, NUM_SLICES] float32
    segments: list[Segment]
    gaps: list[Gap]
    deadline: float  # time.monotonic() after which reads fail
    file_bytes: int
    path: str = ""  # the tensor file (what a part-writer process opens again)
    closed: bool = field(default=False)
    # the largest |value| each value check saw (appended by the writer's tasks; every value is checked)
    peaks: list[float] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.rank, self.row_elems)  # [num_layers, rank, row_elems]

    @property
    def peak(self) -> float | None:
        """The largest |value| of the adapter's tensors, once every value has been written (else None)."""
        return max(self.peaks) if self.peaks else None

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.rank * self.row_elems * self.dtype.itemsize

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)

    def __enter__(self) -> AdapterPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
