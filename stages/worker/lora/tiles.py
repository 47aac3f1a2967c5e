"""Sizes of the Triton LoRA backend's fixed-shape (graphed) batches and workspace: the tile bound of a
padded batch, its tile classes and their grids, and the split-K room of the partials buffer."""

from __future__ import annotations

MAX_SPLIT_K = 16
# A padded (graphed) batch's kernel configs follow its tile count (the shrink's split-K and column block fill
# the GPU from it), which its graph cannot know. Configs chosen for the tile bound starve a step of few tiles:
# on an H100, 256 decodes over 8 or 32 adapters (21, 37 tiles) took 1.28 and 1.38 ms of LoRA kernels with the
# bound's configs, 0.83 and 1.04 ms with configs for 32 tiles; 80 adapters (82 tiles) 2.38 against 2.26 ms
# with configs for 128. So a padded size has a graph per class: configs for min(bound, c) tiles for each c
# here, and for the bound; a batch takes the first class c with tiles <= 1.5 c.
TILE_CLASSES = (32, 128)


def workspace_rows(max_tokens: int) -> int:
    """Token rows of the shrink's fp32 partials buffer: room for split-K on decode-sized batches."""
    return max(2 * max_tokens, MAX_SPLIT_K * 256)


def split_cap(num_tokens: int, ws_rows: int) -> int:
    """Largest power-of-two split-K (at most MAX_SPLIT_K) whose partials fit `ws_rows` token rows."""
    cap = 1
    while cap < MAX_SPLIT_K and 2 * cap * max(1, num_tokens) <= ws_rows:
        cap *= 2
    return cap


def padded_tile_bound(pad_to: int, block_m: int, num_ids: int, max_seqs: int | None) -> int:
    """Most tiles of `block_m` tokens a padded batch of `pad_to` tokens can have. Runs are one per
    adapter id (the runner orders tokens by id) and one per sequence at most, and sum(ceil(len /
    block_m)) is at most the run count plus pad_to // block_m. Every program past a step's own tiles
    still launches and returns, so the bound is kept tight: with a large pool (762 ids in 4 GB at 1B
    shapes) the ids alone would make a 1,024-token graph launch 3x the programs that 256 sequences can
    need."""
    return min(pad_to, min(num_ids, max_seqs or pad_to) + pad_to // block_m)


def class_grid(tile_class: int, bound: int) -> int:
    """Tiles the grids of a padded batch's class cover: the bound for the bound's class, else 1.5 times
    the class (at most the bound). "auto" puts a batch in the first class whose grid holds its tiles: a
    decode step of few adapters on the bound's grid would launch 8x the programs it needs, and the empty
    ones cost a third of its LoRA time."""
    return bound if tile_class == bound else min(bound, tile_class * 3 // 2)


def classes_of(bound: int) -> tuple[int, ...]:
    """The tile classes of a padded batch whose tile bound is `bound`, ascending: the bound last."""
    return tuple(sorted({min(bound, c) for c in TILE_CLASSES} | {bound}))
