"""Executes an `AdapterPlan` into a packed block: each chunk is one positioned read into a reusable
per-thread buffer, then each tensor is converted to the block's dtype straight into its rows (B through a
transposing copy), its values checked on the way. Torch copies and reads release the GIL; parts of one
plan may run on several threads at once."""

from __future__ import annotations

import threading

import torch

from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_plan import AdapterPlan, Chunk, Piece
from stages.loader.safetensors_reader import FLOAT_DTYPES, FormatError, read_exact

_ALIGN = 8  # a chunk sits in its buffer at its file offset mod 8, so aligned tensors stay aligned
_local = threading.local()


def write_all(plan: AdapterPlan, block: torch.Tensor) -> None:
    """Every part of the plan, one after the other, into `block` ([num_layers, rank, row_elems])."""
    for part in range(plan.num_parts):
        write_part(plan, part, block)


def write_part(plan: AdapterPlan, part: int, block: torch.Tensor) -> None:
    """Part 0 zeroes the regions no tensor covers; part i >= 1 reads and packs chunk i - 1. A bad value
    or a failed read raises AdapterError; the caller then discards the whole block."""
    if tuple(block.shape) != plan.shape or block.dtype != plan.dtype:
        raise ValueError(f"block {tuple(block.shape)} {block.dtype} does not match the plan {plan.shape}")
    if part == 0:
        for g in plan.gaps:
            rows = block[:, g.row0 : g.row1] if g.layer is None else block[g.layer, g.row0 : g.row1]
            rows[..., g.col0 : g.col1].zero_()
        return
    chunk = plan.chunks[part - 1]
    data = _read_chunk(plan, chunk)
    limit = torch.finfo(plan.dtype).max
    for piece in chunk.pieces:
        src = _source(data, chunk, piece)
        _check_values(plan, piece, src, limit)
        dst = block[piece.layer, : piece.rank, piece.col : piece.col + piece.width]  # [r, width]
        if not piece.transpose:
            dst.copy_(src)  # A [r, in]: rows as they are, converted
        elif src.dtype == plan.dtype:
            dst.copy_(src.t())  # B [out, r] → B^T
        else:  # convert contiguously first: a converting transposed copy is about twice slower
            tmp = _scratch(src.numel() * plan.dtype.itemsize).view(plan.dtype)[: src.numel()]
            dst.copy_(tmp.view(src.shape).copy_(src).t())


def _read_chunk(plan: AdapterPlan, chunk: Chunk) -> torch.Tensor:
    """The chunk's bytes, as a uint8 view of this thread's buffer whose index 0 is file byte chunk.start."""
    lead = chunk.start % _ALIGN
    n = chunk.end - chunk.start
    raw, view = _buffer(lead + n)
    try:
        read_exact(plan.fd, raw[lead : lead + n], chunk.start, plan.deadline)
    except FormatError as e:
        raise AdapterError(plan.name, f"unreadable adapter_model.safetensors ({e})") from None
    return view[lead : lead + n]


def _source(data: torch.Tensor, chunk: Chunk, piece: Piece) -> torch.Tensor:
    e = piece.entry
    dtype = FLOAT_DTYPES[e.dtype]
    raw = data[e.start - chunk.start : e.end - chunk.start]
    if e.start % dtype.itemsize:  # the format allows unaligned tensors; copy those to aligned memory
        raw = raw.clone()
    return raw.view(dtype).view(e.shape)


def _check_values(plan: AdapterPlan, piece: Piece, src: torch.Tensor, limit: float) -> None:
    """One pass, no temporaries: NaN propagates through min/max, and anything beyond the block dtype's
    range (inf included) would not survive the conversion."""
    lo, hi = torch.aminmax(src)
    if -limit <= lo.item() and hi.item() <= limit:
        return
    where = f"{piece.module} of layer {piece.layer}"
    if not bool(torch.isfinite(src).all()):
        raise AdapterError(plan.name, f"{where} holds NaN or infinite values")
    dtype = str(plan.dtype).removeprefix("torch.")
    raise AdapterError(plan.name, f"{where} holds values beyond the range of {dtype} (the serving dtype)")


def _buffer(n: int) -> tuple[memoryview, torch.Tensor]:
    """This thread's read buffer of at least n bytes (grown, never shrunk; allocated zeroed, so its pages
    are already faulted in when a read lands there)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf[0]) < n:
        size = max(n, 1 << 20)
        raw = bytearray(size)
        buf = (memoryview(raw), torch.frombuffer(raw, dtype=torch.uint8))
        _local.buf = buf
    return buf


def _scratch(n: int) -> torch.Tensor:
    """This thread's conversion scratch of at least n bytes (uint8)."""
    t = getattr(_local, "scratch", None)
    if t is None or t.numel() < n:
        t = torch.empty(max(n, 1 << 20), dtype=torch.uint8)
        _local.scratch = t
    return t[:n]
