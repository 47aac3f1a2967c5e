"""Executes an `AdapterPlan` into a packed block: each chunk is one positioned read into a reusable
per-thread buffer, then each tensor is converted to the block's dtype straight into its rows (B through a
transposing copy), its values checked on the way. Torch copies and reads release the GIL; parts of one
plan may run on several threads at once."""

from __future__ import annotations

import threading

import torch

from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_plan import AdapterPlan, Chunk, Piece, Run
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
    if tuple(block.shape) != plan.shape or block.dtype != plan.dtype or not block.is_contiguous():
        raise ValueError(f"block {tuple(block.shape)} {block.dtype} does not match the plan {plan.shape}")
    if part == 0:
        for g in plan.gaps:
            rows = block[:, g.row0 : g.row1] if g.layer is None else block[g.layer, g.row0 : g.row1]
            rows[..., g.col0 : g.col1].zero_()
        return
    chunk = plan.chunks[part - 1]
    lead, data, whole = _read_chunk(plan, chunk)
    limit = torch.finfo(plan.dtype).max
    if chunk.dtype is not None and all(r.aligned for r in chunk.runs):  # one check over every byte read
        typed = whole.view(FLOAT_DTYPES[chunk.dtype])
        size = typed.element_size()
        if not _within(typed[lead // size : (lead + chunk.end - chunk.start) // size], limit):
            _find_bad_values(plan, chunk, data, limit)
        checked = True
    else:
        checked = False
    for run in chunk.runs:
        if run.aligned:
            _copy_run(plan, run, lead - chunk.start, whole, block, limit, checked, chunk, data)
        else:
            for piece in run.pieces:
                src = _source(data, chunk, piece)
                _check_values(plan, piece, src, limit)
                _copy(plan, src.unsqueeze(0), _dst(plan, block, piece, 1, 0), piece.transpose)


def _copy_run(
    plan: AdapterPlan,
    run: Run,
    shift: int,
    whole: torch.Tensor,
    block: torch.Tensor,
    limit: float,
    checked: bool,
    chunk: Chunk,
    data: torch.Tensor,
) -> None:
    """One strided copy for all the run's tensors: source [P, a, b] in the read buffer (file byte o at
    buffer byte o + shift), destination [P, r, width] rows of layers layer0, layer0 + layer_step, ..."""
    first = run.pieces[0]
    typed = whole.view(FLOAT_DTYPES[first.entry.dtype])
    size = typed.element_size()
    a, b = first.entry.shape
    src = typed.as_strided(
        (len(run.pieces), a, b), (run.step // size, b, 1), (first.entry.start + shift) // size
    )
    if not checked and not _within(src, limit):
        _find_bad_values(plan, chunk, data, limit)
    _copy(plan, src, _dst(plan, block, first, len(run.pieces), run.layer_step), first.transpose)


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


def _within(src: torch.Tensor, limit: float) -> bool:
    """One pass, no temporaries: NaN propagates through min/max; beyond `limit` (inf included) would not
    survive the conversion to the block's dtype."""
    lo, hi = torch.aminmax(src)
    return -limit <= lo.item() and hi.item() <= limit


def _find_bad_values(plan: AdapterPlan, chunk: Chunk, data: torch.Tensor, limit: float) -> None:
    """The chunk failed its check: name the first tensor that holds the bad values."""
    for piece in chunk.pieces:
        _check_values(plan, piece, _source(data, chunk, piece), limit)
    raise AssertionError("a chunk failed its value check but none of its tensors did")


def _read_chunk(plan: AdapterPlan, chunk: Chunk) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(lead, data, whole): the chunk read into this thread's buffer `whole` (uint8) at byte `lead`
    (= chunk.start mod 8, so aligned tensors stay aligned); `data` is the chunk's bytes alone."""
    lead = chunk.start % _ALIGN
    n = chunk.end - chunk.start
    raw, whole = _buffer(lead + n)
    try:
        read_exact(plan.fd, raw[lead : lead + n], chunk.start, plan.deadline)
    except FormatError as e:
        raise AdapterError(plan.name, f"unreadable adapter_model.safetensors ({e})") from None
    return lead, whole[lead : lead + n], whole


def _source(data: torch.Tensor, chunk: Chunk, piece: Piece) -> torch.Tensor:
    e = piece.entry
    dtype = FLOAT_DTYPES[e.dtype]
    raw = data[e.start - chunk.start : e.end - chunk.start]
    if e.start % dtype.itemsize:  # the format allows unaligned tensors; copy those to aligned memory
        raw = raw.clone()
    return raw.view(dtype).view(e.shape)


def _check_values(plan: AdapterPlan, piece: Piece, src: torch.Tensor, limit: float) -> None:
    if _within(src, limit):
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
        size = (max(n, 1 << 20) + _ALIGN - 1) // _ALIGN * _ALIGN  # whole items of any dtype
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
