"""How an adapter's tensors are cut for parallel work: segments of whole layers (the bytes held at once),
reads of whole tensors within a segment, and runs (tensors of one kind evenly spaced in the file and in
the block's layers: one strided copy each) dealt out to pack tasks. Few, large operations: every torch
call takes and gives back the GIL, and with many threads each hand-over costs more than small copies."""

from __future__ import annotations

from stages.loader.adapter_plan import Piece, ReadLimits, Run, Segment
from stages.loader.safetensors_reader import ITEM_SIZES


def make_segments(pieces: list[Piece], limits: ReadLimits) -> list[Segment]:
    """Pieces in file order, cut at layer boundaries into segments of at most `segment_bytes` (a layer
    larger than that is cut between tensors). The header check guarantees the tensors tile the data
    section, so a segment is one byte range."""
    spans: list[list[Piece]] = []
    for group in _layer_groups(sorted(pieces, key=lambda p: p.entry.start)):
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
    loads: list[tuple[int, list[Run]]] = [(0, []) for _ in range(max(1, min(tasks, len(runs))))]
    for run in sorted(runs, key=lambda r: -sum(p.entry.nbytes for p in r.pieces)):
        i = min(range(len(loads)), key=lambda k: loads[k][0])
        loads[i] = (loads[i][0] + sum(p.entry.nbytes for p in run.pieces), loads[i][1] + [run])
    return tuple(tuple(group) for _, group in loads if group)


def _runs(span: list[Piece]) -> list[Run]:
    """The span's pieces grouped into runs: one kind, a constant file step, a constant positive layer step."""
    kinds: dict[tuple, list[Piece]] = {}
    for p in span:
        kinds.setdefault((p.module, p.transpose, p.entry.dtype, p.entry.shape), []).append(p)
    runs: list[Run] = []
    for same in kinds.values():
        run: list[Piece] = []
        for p in same:
            if p.entry.start % ITEM_SIZES[p.entry.dtype]:
                runs.append(Run((p,), 0, 0, aligned=False))
                continue
            if run and not _extends(run, p):
                runs.append(_run(run))
                run = []
            run.append(p)
        if run:
            runs.append(_run(run))
    return runs


def _extends(run: list[Piece], p: Piece) -> bool:
    if len(run) == 1:
        return p.layer > run[0].layer
    step, layer_step = run[1].entry.start - run[0].entry.start, run[1].layer - run[0].layer
    return p.entry.start - run[-1].entry.start == step and p.layer - run[-1].layer == layer_step


def _run(pieces: list[Piece]) -> Run:
    if len(pieces) == 1:
        return Run((pieces[0],), 0, 0, aligned=True)
    step = pieces[1].entry.start - pieces[0].entry.start
    return Run(tuple(pieces), step, pieces[1].layer - pieces[0].layer, aligned=True)
