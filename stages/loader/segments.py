"""How an adapter's tensors are cut for parallel work: segments of whole layers (the bytes held at once),
parts of whole tensors within a segment (one task each: its read, its value check and its packs, with
no wait for other parts), and within a part runs (tensors of one kind evenly spaced in the file and in
the block's layers: one strided copy each). Few, large operations: every torch call takes and gives
back the GIL, and with many threads each hand-over costs more than small copies."""

from __future__ import annotations

from operator import attrgetter

from proto.loader_parts import Part, Piece, Run
from stages.loader.adapter_plan import ReadLimits, Segment
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
    """One segment's parts: whole tensors in file order, cut into byte ranges of about equal size, at
    most `limits.tasks` of them (each at least `limits.min_part_bytes` and at most `limits.read_bytes`,
    or one tensor)."""
    total = span[-1].entry.end - span[0].entry.start
    want = min(limits.read_bytes, max(limits.min_part_bytes, -(-total // max(1, limits.tasks))))
    parts: list[list[Piece]] = []
    open_bytes = 0  # of the last part
    for p in span:
        size = p.entry.end - p.entry.start
        if not parts or (parts[-1] and (open_bytes >= want or open_bytes + size > limits.read_bytes)):
            parts.append([])
            open_bytes = 0
        parts[-1].append(p)
        open_bytes += size
    return Segment(
        start=span[0].entry.start,
        end=span[-1].entry.end,
        pieces=tuple(span),
        parts=tuple(_part(part) for part in parts),
    )


def _part(span: list[Piece]) -> Part:
    entries = list(map(_ENTRY, span))
    starts, dtypes = list(map(_START, entries)), list(map(_DTYPE, entries))
    runs = [r for _, r in _runs(span, starts, dtypes, list(map(_SHAPE, entries)))]
    kinds = set(dtypes)
    single = len(kinds) == 1 and all(map(_ALIGNED, runs))
    return Part(
        start=starts[0],
        end=entries[-1].end,
        runs=tuple(runs),
        dtype=kinds.pop() if single else None,
    )


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
