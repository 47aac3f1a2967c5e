"""What the kernel warm-up compiles: every Triton kernel variant a serving step can reach, enumerated from
the same heuristics that pick them per batch (LoRA shrink/expand configs, attention block rows and key
splits), so that the warm-up cannot drift from them. `warmup.py` launches the plan.

A variant is fixed by a kernel's constexprs and launch options (the integers that change per batch are
either not passed or not specialised on: Triton would otherwise make a variant per batch size class,
1, a multiple of 16 or neither, that no config names; `tests/stages/worker/test_warmup_specs.py` checks
this against the runner's eager steps). The heuristics see a batch only through host-known sizes:
- LoRA (`TritonLoraBackend.configs_for`): token count T (through `token_class`: the split-K cap of
  the workspace, and whether T passes the sequence bound), tile count, token tile `block_m` (from the
  longest adapter run and T) and rank tile `block_rank`; and the pool's row dtype (one per server: the
  model's, or e4m3 with `--lora-dtype fp8`). Every T in 1..max_tokens is covered, in runs of one token
  class and one `block_m` shape (`token_classes`), with every longest run (in spans of one `block_m`),
  every tile count a batch can have (`tile_range`, the bounds of `kernels.batch_info.plan_tiles`; the
  configs asked only where bisection finds them change) and every rank class; the sweep over every T
  stays the reference in `tests/stages/worker/test_warmup_plan.py`. Padded batches (CUDA graphs: decode
  sizes, and the step graphs' token buckets with their token tile) add their configurations, made by
  `prepare(pad_to=...)` itself: one for each tile class of a decode size, one (the tile bound's) for a
  step graph.
- attention (`kernels.paged_attention`): `block_m` from the rows of the longest query
  (`decode_block_m`) and the key splits (`choose_splits`) over every block count and context length.
- the weight-only fp8 GEMM (`kernels.fp8_gemm.choose_config`), with fp8 base weights: each projection's
  shape and bias with the config of every token count 1..MAX_M (more tokens run `torch._scaled_mm`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kernels.batch_info import BatchInfo, block_rank_for, choose_block_m
from kernels.fp8_gemm import GemmConfig, configs_for
from kernels.paged_attention import choose_splits, decode_block_m
from stages.worker.lora.triton_backend import TritonLoraBackend
from stages.worker.model.linear import Fp8Weight
from stages.worker.model.weights import LayerWeights


@dataclass(frozen=True)
class LoraLaunch:
    """One shrink + expand launch pair of one fused group, with the batch sizes that select it."""

    group: str
    num_tokens: int
    num_tiles: int
    block_m: int
    block_rank: int
    # (group, block_m, block_rank, ShrinkConfig, ExpandConfig, pool row dtype): what gets compiled; the
    # row dtype (the model's, or e4m3 with `--lora-dtype fp8`) picks the kernels' SCALED variants
    key: tuple


def rank_classes(max_rank: int) -> list[int]:
    """Every rank tile a batch can have: `block_rank_for` of each real rank 1..max_rank."""
    return sorted({block_rank_for(r) for r in range(1, max_rank + 1)})


def tile_range(num_tokens: int, max_len, block_m: int, num_slots: int) -> tuple:
    """Fewest and most token tiles of a batch of `num_tokens` tokens whose longest adapter run has
    `max_len` tokens (an int or an array of them), with at most `num_slots` runs (one per adapter slot,
    `plan_runs`), each cut into tiles of `block_m` (`plan_tiles`). Every count in between is reachable
    (lengthening or adding a run changes it by at most one)."""
    first = -(-max_len // block_m)  # the longest run's tiles
    budget = num_tokens - max_len  # tokens left for the other runs
    k = np.minimum(num_slots - 1, budget)  # other runs, one token at least each
    # Each other run gives 1 + (len - 1) // block_m tiles and is at most max_len tokens long.
    return first, first + k + np.minimum((budget - k) // block_m, k * ((max_len - 1) // block_m))


def _pieces(f: Callable[[int], Hashable], first: int, last: int, powers: bool = True) -> list[tuple]:
    """[(a, b, f(a))]: first..last in runs of one answer of `f`. It is asked at both ends (and, with
    `powers`, each side of every power of two); where two neighbouring answers differ, both halves are
    bisected until every change is found. Exact for an `f` that never comes back between two points to
    an answer it left (each part of the answer monotone, as thresholds make it)."""
    points = {first, last}
    p = 2
    while powers and p <= last:
        points.update(x for x in (p - 1, p, p + 1) if first <= x <= last)
        p *= 2
    answers = {x: f(x) for x in points}
    todo = list(itertools.pairwise(sorted(points)))
    while todo:
        a, b = todo.pop()
        if b - a > 1 and answers[a] != answers[b]:
            mid = (a + b) // 2
            answers[mid] = f(mid)
            todo += [(a, mid), (mid, b)]
    marks = sorted(answers)
    spans, start = [], marks[0]
    for a, b in itertools.pairwise(marks):
        if answers[b] != answers[a]:
            spans.append((start, a, answers[a]))
            start = b
    spans.append((start, marks[-1], answers[marks[-1]]))
    return spans


def block_m_spans(num_tokens: int) -> list[tuple[int, int, int]]:
    """[(first, last, block_m)]: the longest-run lengths 1..num_tokens in spans of one `choose_block_m`
    answer (`tests/stages/worker/test_warmup_plan.py` checks every length)."""
    return _pieces(lambda max_len: choose_block_m(max_len, num_tokens), 1, num_tokens)


def token_classes(backend: TritonLoraBackend) -> list[tuple[int, int]]:
    """[(first, last)]: the token counts 1..max_tokens in runs over which the configs read the same of
    the token count (`token_class`) and `block_m_spans` has one shape (the same spans but the last, which
    ends at the count). A run's batches thus give every longest run the token tile its last count gives
    it, and each tile count those batches reach, its last count reaches too (adding base-only tokens to a
    batch keeps its runs): the run's batches are its last count's."""

    def shape(t: int) -> tuple:
        spans = tuple((a, b if b < t else 0, bm) for a, b, bm in block_m_spans(t))
        return backend.token_class(t), spans

    return [(a, b) for a, b, _ in _pieces(shape, 1, backend.max_tokens)]


def _merged(lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int]]:
    """The union of the intervals [lo[i], hi[i]] of integers, as disjoint intervals, ascending."""
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    cut = np.flatnonzero(lo[1:] > reach[:-1] + 1) + 1  # a gap: the next interval starts past all before
    starts, ends = np.r_[0, cut], np.r_[cut - 1, len(lo) - 1]
    return [(int(a), int(b)) for a, b in zip(lo[starts], reach[ends], strict=True)]


def lora_launches(
    backend: TritonLoraBackend, padded_sizes: Sequence[int | tuple[int, int]] = ()
) -> list[LoraLaunch]:
    """One launch per distinct LoRA kernel variant: eager batches of every size, tile count and rank
    class, then padded batches of each graph: a decode size, or (tokens, token tile) of a step graph.
    Leaves an empty batch prepared (its device header says 0 tiles, so the launches compile their
    kernels and compute nothing).

    Eager batches: per token-count run (`token_classes`), token tile and rank class, the configs of each
    interval of reachable tile counts are found by bisection (`_pieces`: as tiles grow, the configs never
    come back to an answer they left, since each threshold on the tile count is crossed once: fewer
    splits within one column block, then wider blocks, no dependent launch past a bound), asked once
    per (token class, token tile, rank tile, tile count)."""
    backend.prepare([0], [])
    empty = backend.batch_info
    assert empty is not None
    launches: list[LoraLaunch] = []
    seen: set[tuple] = set()

    def add(info: BatchInfo) -> tuple:
        """The variants of `info`'s configs, planned where new."""
        found = tuple(
            (name, info.block_m, info.block_rank, shrink, expand, backend.pool.mem.dtype)
            for name, (shrink, expand, _) in backend.configs_for(info).items()
        )
        for key in found:
            if key not in seen:
                seen.add(key)
                launches.append(
                    LoraLaunch(key[0], info.num_tokens, info.num_tiles, info.block_m, info.block_rank, key)
                )
        return found

    num_slots = backend.pool.num_ids  # distinct adapters (runs) one batch can hold
    ranks = rank_classes(backend.layout.max_rank)
    asked: dict[tuple, tuple] = {}
    for _, t in token_classes(backend):
        by_bm: dict[int, list[tuple]] = {}
        for a, b, bm in block_m_spans(t):
            by_bm.setdefault(bm, []).append(tile_range(t, np.arange(a, b + 1), bm, num_slots))
        for bm, ranges in sorted(by_bm.items()):
            merged = _merged(*(np.concatenate(x) for x in zip(*ranges, strict=True)))
            for br in ranks:
                for lo, hi in merged:

                    def at(tiles: int, t=t, bm=bm, br=br) -> tuple:
                        memo = (backend.token_class(t), bm, br, tiles)
                        if memo not in asked:
                            info = replace(
                                empty, num_tokens=t, num_tiles=tiles, block_m=bm,
                                max_len=min(t, tiles * bm), block_rank=br,
                                num_slots_used=min(num_slots, tiles),
                            )  # fmt: skip
                            asked[memo] = add(info)
                        return asked[memo]

                    _pieces(at, int(lo), int(hi), powers=False)
    for spec in padded_sizes:
        size, block_m = spec if isinstance(spec, tuple) else (spec, None)
        # Decode graphs (a size alone) have a graph per tile class; step graphs use the tile bound.
        classes = (None,) if isinstance(spec, tuple) else backend.tile_classes(size, block_m)
        for c in classes:
            backend.prepare([0], [], pad_to=size, block_m=block_m, tile_class=c)
            padded = backend.batch_info
            assert padded is not None
            add(replace(padded, num_tiles=backend.tile_class))  # the configs of the class's tile count
    backend.prepare([0], [])
    return launches


def _key_samples(max_keys: int) -> set[int]:
    out, p = {1, max_keys}, 2
    while p <= max_keys:
        out.update(x for x in (p - 1, p, p + 1) if x <= max_keys)
        p *= 2
    return out


def attention_variants(
    *,
    num_heads: int,
    num_kv_heads: int,
    max_tokens: int,
    max_seqs: int,
    max_model_len: int,
    device: object,
) -> list[tuple[int, int]]:
    """(block_m, key splits) pairs of the attention kernel an eager step can choose: block rows from the
    longest query (1..max_tokens tokens), splits over every block count and context length."""
    group = num_heads // num_kv_heads
    rows = sorted({decode_block_m(q * group) for q in range(1, max_tokens + 1)})
    keys = sorted(_key_samples(max_model_len))

    def at(blocks: int) -> tuple[int, ...]:
        return tuple(choose_splits(blocks, num_kv_heads, k, device) for k in keys)

    out = []
    for bm in rows:
        max_blocks = -(-max_tokens * group // bm) + min(max_seqs, max_tokens)  # a partial block per seq
        # every block count 1..max_blocks, bisected (for each key count, fewer splits as blocks grow)
        splits = {s for _, _, answer in _pieces(at, 1, max_blocks) for s in answer}
        out.extend((bm, s) for s in sorted(splits))
    return out


@dataclass(frozen=True)
class Fp8Launch:
    """One weight-only fp8 GEMM variant: a projection and the token count whose config it is."""

    proj: str  # a LayerWeights field: qkv, o, gate_up, down
    num_tokens: int
    config: GemmConfig


def fp8_launches(layer: LayerWeights, sms: int) -> list[Fp8Launch]:
    """One launch per variant of the weight-only fp8 GEMM a step can reach (none without fp8 weights).
    Every layer's projection has the same shape and bias as layer 0's."""
    out = []
    for proj in ("qkv", "o", "gate_up", "down"):
        w = getattr(layer, proj)
        if isinstance(w, Fp8Weight):
            for config, (m, _, _) in configs_for([tuple(w.shape)], sms).items():
                out.append(Fp8Launch(proj, m, config))
    return out


def plan_axes(launches: Sequence[LoraLaunch], attention: Sequence[tuple[int, int]]) -> str:
    """How many distinct values each axis of the plan holds (the variants are the combinations that
    the heuristics reach, not the product), for the warm-up's log."""
    keys = [launch.key for launch in launches]
    lora = {
        "group": {k[0] for k in keys},
        "block_m": {k[1] for k in keys},
        "block_rank": {k[2] for k in keys},
        "shrink config": {k[3] for k in keys},
        "expand config": {k[4] for k in keys},
        "token count": {launch.num_tokens for launch in launches},
        "tile count": {launch.num_tiles for launch in launches},
    }
    attn = {"block_m": {b for b, _ in attention}, "key splits": {s for _, s in attention}}

    def show(axes: dict[str, set]) -> str:
        def values(v: set) -> str:
            return (
                "{" + ",".join(map(str, sorted(v))) + "}"
                if len(v) <= 4 and all(isinstance(x, int) for x in v)
                else ""
            )

        return ", ".join(f"{name} {len(v)}{values(v)}" for name, v in axes.items())

    return f"LoRA axes: {show(lora)}; attention axes: {show(attn)}"
