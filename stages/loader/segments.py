"""How an adapter's tensors are cut for parallel work: segments of whole layers (the bytes held at once),
reads of whole tensors within a segment, and runs (tensors of one kind evenly spaced in the file and in
the block's layers: one strided copy each) dealt out to pack tasks. Few, large operations: every torch
call takes and gives back the GIL, and with many threads each hand-over costs more than small copies."""

from __future__ import annotations

from operator import attrgetter

from stages.loader.adapter_plan import Piece, ReadLimits, Run, Segment
from stages.loader.safetensors_format import ITEM_SIZES

_ENTRY, _LAYER, _MODULE, _TRANSPOSE = (
    attrgetter("entry"),
    attrgetter("layer"),
    attrgetter("module"),
    attrgetter("transpose"),
)
_START, _END, _DTYPE, _SHAPE = (
    attrgetter("start"),
    attrgetter("end"),
    attrgetter("dtype"),
    attrgetter("shape"),
)
_ALIGNED = attrgetter("aligned")
_new = tuple.__new__  # Run(...) without its Python-level __new__


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
    entries = list(map(_ENTRY, span))
    starts, ends, dtypes = list(map(_START, entries)), list(map(_END, entries)), list(map(_DTYPE, entries))
    runs = _runs(span, starts, dtypes, list(map(_SHAPE, entries)))
    sizes = [sum(map(ends.__getitem__, run)) - sum(map(starts.__getitem__, run)) for run, _ in runs]
    runs = [r for _, r in runs]
    kinds = set(dtypes)
    single = len(kinds) == 1 and all(map(_ALIGNED, runs))
    return Segment(
        start=starts[0],
        end=ends[-1],
        pieces=tuple(span),
        reads=_reads(starts, ends, limits.read_bytes),
        packs=_deal(runs, sizes, limits.pack_tasks),
        dtype=kinds.pop() if single else None,
    )


def _reads(starts: list[int], ends: list[int], read_bytes: int) -> tuple[tuple[int, int], ...]:
    """Byte ranges of whole tensors (given by their `starts` and `ends`), each at most `read_bytes` (or
    one tensor)."""
    out: list[tuple[int, int]] = []
    first, last = None, 0  # the open range
    for start, end in zip(starts, ends, strict=True):
        if first is None or end - first > read_bytes:
            if first is not None:
                out.append((first, last))
            first = start
        last = end
    if first is not None:
        out.append((first, last))
    return tuple(out)


def _deal(runs: list[Run], sizes: list[int], tasks: int) -> tuple[tuple[Run, ...], ...]:
    """Runs (of `sizes` bytes) dealt to at most `tasks` tasks, largest first to the least loaded."""
    loads = [0] * max(1, min(tasks, len(runs)))
    groups: list[list[Run]] = [[] for _ in loads]
    for i in sorted(range(len(runs)), key=sizes.__getitem__, reverse=True):  # stable, as sorting by -size
        k = loads.index(min(loads))  # the first least loaded
        loads[k] += sizes[i]
        groups[k].append(runs[i])
    return tuple(tuple(group) for group in groups if group)


def _runs(span: list[Piece], starts: list[int], dtypes: list[str], shapes: list[tuple]) -> list:
    """The span's pieces grouped into runs: one kind, a constant file step, a constant positive layer step.
    `starts`, `dtypes`, `shapes`: of the pieces' entries. Each run with the positions of its pieces."""
    layers = list(map(_LAYER, span))
    kinds: dict[tuple, list[int]] = {}
    for i, kind in enumerate(zip(map(_MODULE, span), map(_TRANSPOSE, span), dtypes, shapes, strict=True)):
        same = kinds.get(kind)
        if same is None:
            kinds[kind] = [i]
        else:
            same.append(i)
    runs: list = []
    for same in kinds.values():
        item = ITEM_SIZES[dtypes[same[0]]]  # one dtype per kind
        run: list[int] = []
        step = layer_step = 0  # of the run, once it has two pieces
        for i in same:
            start = starts[i]
            if start % item:
                runs.append(([i], _new(Run, ((span[i],), 0, 0, False))))
                continue
            if run:
                last = run[-1]
                if len(run) == 1:  # a second piece: any later layer sets the steps
                    step, layer_step = start - starts[last], layers[i] - layers[last]
                    extends = layer_step > 0
                else:
                    extends = start - starts[last] == step and layers[i] - layers[last] == layer_step
                if not extends:
                    runs.append(_run(span, run, step, layer_step))
                    run = []
            run.append(i)
        if run:
            runs.append(_run(span, run, step, layer_step))
    return runs


def _run(span: list[Piece], run: list[int], step: int, layer_step: int) -> tuple[list[int], Run]:
    if len(run) == 1:
        return run, _new(Run, ((span[run[0]],), 0, 0, True))
    return run, _new(Run, (tuple(map(span.__getitem__, run)), step, layer_step, True))
