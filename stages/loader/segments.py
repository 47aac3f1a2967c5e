"""How an adapter's tensors are cut for parallel work: segments of whole layers (the bytes held at once),
reads of whole tensors within a segment, and runs (tensors of one kind evenly spaced in the file and in
the block's layers: one strided copy each) dealt out to pack tasks. Few, large operations: every torch
call takes and gives back the GIL, and with many threads each hand-over costs more than small copies."""

from __future__ import annotations

from operator import attrgetter

from stages.loader.adapter_plan import Piece, ReadLimits, Run, Segment
from stages.loader.safetensors_format import ITEM_SIZES

_ENTRY, _START, _END = attrgetter("entry"), attrgetter("start"), attrgetter("end")


def make_segments(pieces: list[Piece], limits: ReadLimits) -> list[Segment]:
    """Pieces in file order, cut at layer boundaries into segments of at most `segment_bytes` (a layer
    larger than that is cut between tensors). The header check guarantees the tensors tile the data
    section, so a segment is one byte range."""
    ordered = sorted(pieces, key=lambda p: p.entry.start)
    if ordered and ordered[-1].entry.end - ordered[0].entry.start <= limits.segment_bytes:
        return [_segment(ordered, limits)]  # what the loop below gives when all fits in one segment
    spans: list[list[Piece]] = []
    for group in _layer_groups(ordered):
        if spans and group[-1].entry.end - spans[-1][0].entry.start <= limits.segment_bytes:
            spans[-1] += group
            continue
        spans.append([])
        for p in group:  # a layer alone larger than a segment: cut between its tensors
            if spans[-1] and p.entry.end - spans[-1][0].entry.start > limits.segment_bytes:
                spans.append([])
            spans[-1].append(p)
    return [_segment(span, limits) for span in spans]


def _layer_groups(ordered: list[Piece]) -> list[list[Piece]]:
    groups: list[list[Piece]] = []
    for p in ordered:
        if groups and groups[-1][-1].layer == p.layer:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _segment(span: list[Piece], limits: ReadLimits) -> Segment:
    runs = _runs(span)
    dtypes = {p.entry.dtype for p in span}
    single = len(dtypes) == 1 and all(r.aligned for r in runs)
    return Segment(
        start=span[0].entry.start,
        end=span[-1].entry.end,
        pieces=tuple(span),
        reads=_reads(span, limits.read_bytes),
        packs=_deal(runs, limits.pack_tasks),
        dtype=dtypes.pop() if single else None,
    )


def _reads(span: list[Piece], read_bytes: int) -> tuple[tuple[int, int], ...]:
    """Byte ranges of whole tensors, each at most `read_bytes` (or one tensor)."""
    out: list[list[int]] = []
    for p in span:
        if out and p.entry.end - out[-1][0] <= read_bytes:
            out[-1][1] = p.entry.end
        else:
            out.append([p.entry.start, p.entry.end])
    return tuple((a, b) for a, b in out)


def _deal(runs: list[Run], tasks: int) -> tuple[tuple[Run, ...], ...]:
    """Runs dealt to at most `tasks` tasks, largest first to the least loaded (balanced bytes)."""
    sizes = [sum(map(_END, entries)) - sum(map(_START, entries)) for entries in _entries(runs)]
    loads = [0] * max(1, min(tasks, len(runs)))
    groups: list[list[Run]] = [[] for _ in loads]
    for i in sorted(range(len(runs)), key=sizes.__getitem__, reverse=True):  # stable, as sorting by -size
        k = loads.index(min(loads))  # the first least loaded
        loads[k] += sizes[i]
        groups[k].append(runs[i])
    return tuple(tuple(group) for group in groups if group)


def _entries(runs: list[Run]) -> list[list]:
    return [list(map(_ENTRY, r.pieces)) for r in runs]


def _runs(span: list[Piece]) -> list[Run]:
    """The span's pieces grouped into runs: one kind, a constant file step, a constant positive layer step."""
    kinds: dict[tuple, list[Piece]] = {}
    for p in span:
        e = p.entry
        key = (p.module, p.transpose, e.dtype, e.shape)
        same = kinds.get(key)
        if same is None:
            kinds[key] = [p]
        else:
            same.append(p)
    runs: list[Run] = []
    for same in kinds.values():
        item = ITEM_SIZES[same[0].entry.dtype]  # one dtype per kind
        run: list[Piece] = []
        step = layer_step = 0  # of the run, once it has two pieces
        for p in same:
            start = p.entry.start
            if start % item:
                runs.append(Run((p,), 0, 0, aligned=False))
                continue
            if run:
                last = run[-1]
                if len(run) == 1:  # a second piece: any later layer sets the steps
                    step, layer_step = start - last.entry.start, p.layer - last.layer
                    extends = layer_step > 0
                else:
                    extends = start - last.entry.start == step and p.layer - last.layer == layer_step
                if not extends:
                    runs.append(_run(run))
                    run = []
            run.append(p)
        if run:
            runs.append(_run(run))
    return runs


def _run(pieces: list[Piece]) -> Run:
    if len(pieces) == 1:
        return Run((pieces[0],), 0, 0, aligned=True)
    step = pieces[1].entry.start - pieces[0].entry.start
    return Run(tuple(pieces), step, pieces[1].layer - pieces[0].layer, aligned=True)
