"""Adapter-loader ⇄ its part writers (ROUTER in the loader, one DEALER per writer process): the loader plans
an adapter and reserves its host block, then hands each part of the file (whole tensors: one read, its
value checks, its packs into the block) to a writer process, which answers with the largest magnitude it
saw or the reason it failed. Writers run in their own interpreters so parts never wait on one GIL.

The plan's pieces travel as they are: NamedTuples (cheap to build by the hundred under the planner's
GIL), encoded as msgpack arrays."""

from __future__ import annotations

from typing import NamedTuple

from proto.base import Message, edge


class TensorEntry(NamedTuple):  # a tuple: hundreds are made per adapter, under the GIL
    """One tensor of a safetensors header: `start`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: str  # the format's name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class Piece(NamedTuple):  # a tuple: hundreds are made per adapter, under the GIL
    """One tensor's move: lora_A [r, in] to rows :r at `col`, or lora_B [out, r] transposed there."""

    entry: TensorEntry
    layer: int
    module: str
    col: int
    width: int  # in_dim (A) or the slice's out dim (B)
    rank: int
    transpose: bool  # lora_B


class Run(NamedTuple):  # a tuple: tens are made per adapter, under the GIL
    """Tensors of one kind (module, A or B, dtype, shape) evenly spaced both in the file (`step` bytes)
    and in the block's layers (`layer_step`): moved by one strided copy. `aligned`: every tensor starts
    at a multiple of its item size (the format does not promise it; unaligned ones go one by one)."""

    pieces: tuple[Piece, ...]
    step: int
    layer_step: int
    aligned: bool


class Part(NamedTuple):
    """Whole tensors, file bytes [start, end): one task reads them, checks their values and packs its
    `runs`, apart from every other part. `dtype`: the one dtype of all its tensors if so and all are
    aligned (the read is then checked in one pass; otherwise each run checks its source)."""

    start: int
    end: int
    runs: tuple[Run, ...]
    dtype: str | None


class Gap(NamedTuple):
    """Block region no tensor writes: rows [row0, row1) x columns [col0, col1) of `layer` (None: all)."""

    layer: int | None
    row0: int
    row1: int
    col0: int
    col1: int


class FileId(NamedTuple):
    """What the loader saw of the tensor file when it planned: a writer refuses any other file."""

    dev: int
    ino: int
    size: int
    mtime_ns: int


class WritePart(Message):
    """Write `part` of adapter `name`'s tensor file at `path` into the host pool's block at `offset`
    ([num_layers, rank, row_elems] of `dtype`), zeroing `gaps` first; reads fail after `deadline`
    (time.monotonic(), one clock for every process of the host)."""

    job: int
    name: str
    path: str
    file: FileId
    offset: int
    dtype: str  # the block's torch dtype name, e.g. "bfloat16"
    rank: int
    num_layers: int
    row_elems: int
    deadline: float
    part: Part
    gaps: list[Gap] = []


class PartDone(Message):
    """`job` is written (`peaks`: the largest |value| of each value check), or failed: `error` says why;
    `adapter_fault` when the adapter's file is to blame (bad values, an unreadable or changed file)."""

    job: int
    peaks: list[float] = []
    error: str = ""
    adapter_fault: bool = False


class WriterReady(Message):
    """A writer process is up (its pool attached) and takes parts."""

    pid: int


LoaderToWriter = edge("loader_to_writer", WritePart)
WriterToLoader = edge("writer_to_loader", PartDone, WriterReady)
