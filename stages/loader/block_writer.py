"""Executes an `AdapterPlan` into a packed block. Per segment, its parts as parallel tasks, none waiting
for another: each reads its whole tensors with one positioned read into its place in the segment's
reusable buffer, checks their values (noting their largest magnitude in the plan) and moves its runs of
tensors with one strided copy each (B through a transposing one), converting to the block's dtype on
the way. Torch copies and reads release the GIL; a task holds it only between them."""

from __future__ import annotations

import math
import threading

import torch

from proto.loader_parts import Piece
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_plan import AdapterPlan, Segment
from stages.loader.safetensors_reader import FormatError, read_exact

FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}

_ALIGN = 8  # a segment sits in its buffer at its file offset mod 8, so aligned tensors stay aligned
_local = threading.local()


class SegmentBuffer:
    """Where a segment's bytes land: grown as needed, never shrunk, reused from load to load (allocated
    zeroed, so its pages are faulted in before any read lands there)."""

    def __init__(self) -> None:
        self.raw = memoryview(bytearray(0))
        self.bytes = torch.empty(0, dtype=torch.uint8)

    def ensure(self, n: int) -> None:
        if len(self.raw) < n:
            size = (n + _ALIGN - 1) // _ALIGN * _ALIGN  # whole items of every dtype
            storage = bytearray(size)
            self.raw, self.bytes = memoryview(storage), torch.frombuffer(storage, dtype=torch.uint8)

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        return self.bytes.view(dtype)


def write_all(plan: AdapterPlan, block: torch.Tensor, buf: SegmentBuffer | None = None) -> None:
    """The whole plan on this thread, into `block` ([num_layers, rank, row_elems])."""
    buf = buf or SegmentBuffer()
    zero_gaps(plan, block)
    for s, seg in enumerate(plan.segments):
        prepare(plan, s, buf)
        for i in range(len(seg.parts)):
            write_part(plan, s, i, buf, block)


def prepare(plan: AdapterPlan, s: int, buf: SegmentBuffer) -> None:
    """Make `buf` large enough for segment `s` (before its parts start)."""
    seg = plan.segments[s]
    buf.ensure(seg.start % _ALIGN + seg.end - seg.start)


def zero_gaps(plan: AdapterPlan, block: torch.Tensor) -> None:
    """Zero the block regions no tensor covers (a reused pool block holds an earlier tenant's bytes)."""
    _check_block(plan, block)
    for g in plan.gaps:
        rows = block[:, g.row0 : g.row1] if g.layer is None else block[g.layer, g.row0 : g.row1]
        rows[..., g.col0 : g.col1].zero_()


def write_part(plan: AdapterPlan, s: int, i: int, buf: SegmentBuffer, block: torch.Tensor) -> None:
    """Part i of segment s: read, check and pack it."""
    read_part(plan, s, i, buf)
    pack_part(plan, s, i, buf, block)


def read_part(plan: AdapterPlan, s: int, i: int, buf: SegmentBuffer) -> None:
    """Read part i of segment s into its place in `buf`; when the part is of one dtype, check the values
    read (NaN, inf, or beyond the block dtype's range) in the same pass."""
    seg, part = plan.segments[s], plan.segments[s].parts[i]
    at = _shift(seg) + part.start
    try:
        read_exact(plan.fd, buf.raw[at : at + part.end - part.start], part.start, plan.deadline)
    except FormatError as e:
        raise AdapterError(plan.name, f"unreadable adapter_model.safetensors ({e})") from None
    if part.dtype is not None:
        typed = buf.typed(FLOAT_DTYPES[part.dtype])
        size = typed.element_size()
        peak = _peak(typed[at // size : (at + part.end - part.start) // size])
        if not peak <= _limit(plan):  # NaN compares false
            _name_bad_values(plan, seg, buf, [p for r in part.runs for p in r.pieces])
        plan.peaks.append(peak)


def pack_part(plan: AdapterPlan, s: int, i: int, buf: SegmentBuffer, block: torch.Tensor) -> None:
    """The runs of part i of segment s (after its read), each in one strided copy."""
    seg, part = plan.segments[s], plan.segments[s].parts[i]
    _check_block(plan, block)
    for run in part.runs:
        if not run.aligned:  # one tensor, copied out to aligned memory first
            (piece,) = run.pieces
            src = _source(buf, seg, piece)
            _check_values(plan, piece, src, _limit(plan))
            _copy(plan, src.unsqueeze(0), _dst(plan, block, piece, 1, 0), piece.transpose)
            continue
        first = run.pieces[0]
        typed = buf.typed(FLOAT_DTYPES[first.entry.dtype])
        size = typed.element_size()
        a, b = first.entry.shape
        offset = (_shift(seg) + first.entry.start) // size
        src = typed.as_strided((len(run.pieces), a, b), (run.step // size, b, 1), offset)  # [P, a, b]
        if part.dtype is None:
            peak = _peak(src)
            if not peak <= _limit(plan):
                _name_bad_values(plan, seg, buf, list(run.pieces))
            plan.peaks.append(peak)
        _copy(plan, src, _dst(plan, block, first, len(run.pieces), run.layer_step), first.transpose)


def _shift(seg: Segment) -> int:
    """Buffer index of file byte o is o + shift: the segment starts at its file offset mod 8."""
    return seg.start % _ALIGN - seg.start


def _limit(plan: AdapterPlan) -> float:
    return torch.finfo(plan.dtype).max


def _check_block(plan: AdapterPlan, block: torch.Tensor) -> None:
    if tuple(block.shape) != plan.shape or block.dtype != plan.dtype or not block.is_contiguous():
        raise ValueError(f"block {tuple(block.shape)} {block.dtype} does not match the plan {plan.shape}")


def _dst(plan: AdapterPlan, block: torch.Tensor, first: Piece, count: int, layer_step: int) -> torch.Tensor:
    """[count, r, width] view of the block: rows :r of layers first.layer + i * layer_step, at first.col."""
    row, layer = plan.row_elems, plan.rank * plan.row_elems
    offset = block.storage_offset() + first.layer * layer + first.col
    return block.as_strided((count, first.rank, first.width), (layer_step * layer, row, 1), offset)


def _copy(plan: AdapterPlan, src: torch.Tensor, dst: torch.Tensor, transpose: bool) -> None:
    if not transpose:
        dst.copy_(src)  # A [P, r, in]: rows as they are, converted
    elif src.dtype == plan.dtype:
        dst.copy_(src.transpose(1, 2))  # B [P, out, r] → B^T
    else:  # convert contiguously first: a converting transposed copy is about twice slower
        tmp = _scratch(src.numel() * plan.dtype.itemsize).view(plan.dtype).view(src.shape)
        dst.copy_(tmp.copy_(src).transpose(1, 2))


def _peak(src: torch.Tensor) -> float:
    """The largest |value|, in one pass with no temporaries (NaN propagates through min/max). Beyond the
    block dtype's largest value (inf included) it would not survive the conversion; below, the plan keeps
    it for the effective-delta check's first, cheap bound."""
    lo, hi = (x.item() for x in torch.aminmax(src))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


def _name_bad_values(plan: AdapterPlan, seg: Segment, buf: SegmentBuffer, pieces: list[Piece]) -> None:
    """A check failed over several tensors: raise naming the first one that holds bad values."""
    for piece in sorted(pieces, key=lambda p: (p.layer, p.module)):
        _check_values(plan, piece, _source(buf, seg, piece), _limit(plan))
    raise AssertionError("a value check failed but none of its tensors did")


def _check_values(plan: AdapterPlan, piece: Piece, src: torch.Tensor, limit: float) -> None:
    peak = _peak(src)
    if peak <= limit:
        plan.peaks.append(peak)
        return
    where = f"{piece.module} of layer {piece.layer}"
    if not bool(torch.isfinite(src).all()):
        raise AdapterError(plan.name, f"{where} holds NaN or infinite values")
    dtype = str(plan.dtype).removeprefix("torch.")
    raise AdapterError(plan.name, f"{where} holds values beyond the range of {dtype} (the serving dtype)")


def _source(buf: SegmentBuffer, seg: Segment, piece: Piece) -> torch.Tensor:
    e = piece.entry
    dtype = FLOAT_DTYPES[e.dtype]
    at = _shift(seg) + e.start
    raw = buf.bytes[at : at + e.nbytes]
    if e.start % dtype.itemsize:  # the format allows unaligned tensors; copy those to aligned memory
        raw = raw.clone()
    return raw.view(dtype).view(e.shape)


def _scratch(n: int) -> torch.Tensor:
    """This thread's conversion scratch of at least n bytes (uint8)."""
    t = getattr(_local, "scratch", None)
    if t is None or t.numel() < n:
        t = torch.empty(max(n, 1 << 20), dtype=torch.uint8)
        _local.scratch = t
    return t[:n]
