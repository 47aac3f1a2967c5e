"""Where a validated adapter's tensors go in the packed block: one `Piece` per tensor (its columns in a
rank row, its rank), and the per-layer, per-slice rank and scaling tables. For a file holding exactly
the expected tensors all but the pieces' entries is fixed by (expected table, layout), so it is worked
out once and each load only zips its entries in."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import chain, repeat

from proto.loader_parts import Piece
from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout
from stages.loader.adapter_modules import Expected
from stages.loader.safetensors_format import TensorEntry


@dataclass(frozen=True)
class Placed:
    """The pieces (lora_A then lora_B of each module, in (layer, module) order) and the tables, the
    latter read-only (they may be shared between loads)."""

    rank: int  # the largest of the adapter
    ranks: list[list[int]]  # [num_layers][NUM_SLICES], 0 where the adapter has no tensor
    scalings: list[list[float]]  # [num_layers][NUM_SLICES]
    pieces: list[Piece]


@lru_cache(maxsize=64)
def _slots(layout: LoraLayout) -> dict[str, tuple[int, int, int, int, int]]:
    """{module: (slice id, A's column, in_dim, B's column, out dim)} in a rank row of `layout`."""
    out = {}
    for module in TARGET_MODULES:
        g, s = layout.module_slot(module)
        a_col, b_col = g.a_offset + s * g.in_stride, g.b_offset + g.out_offsets[s]
        out[module] = (TARGET_MODULES.index(module), a_col, g.in_dim, b_col, g.out_dims[s])
    return out


def place_pairs(pairs: dict, exp: Expected, layout: LoraLayout) -> Placed:
    """The general form: `pairs` {(layer, module): (A entry, B entry)} of targeted modules, checked."""
    ranks = [[0] * NUM_SLICES for _ in range(layout.num_layers)]
    scalings = [[0.0] * NUM_SLICES for _ in range(layout.num_layers)]
    pieces = []
    slots = _slots(layout)
    for (layer, module), (a, b) in pairs.items():
        sid, a_col, in_dim, b_col, out_dim = slots[module]
        r = a.shape[0]
        ranks[layer][sid] = r
        scalings[layer][sid] = exp.rank_scaling[layer, module][1]
        pieces.append(Piece(a, layer, module, a_col, in_dim, r, False))
        pieces.append(Piece(b, layer, module, b_col, out_dim, r, True))
    return Placed(max(a.shape[0] for a, _ in pairs.values()), ranks, scalings, pieces)


def place_expected(a: list[TensorEntry], b: list[TensorEntry], exp: Expected, layout: LoraLayout) -> Placed:
    """What `place_pairs` gives when A and B entries are exactly `exp`'s, in `exp.modules` order."""
    t = _template(exp, layout)
    new = tuple.__new__  # Piece(...) without its Python-level __new__
    pa = map(new, repeat(Piece), zip(a, t.layers, t.modules, t.a_cols, t.in_dims, t.ranks, repeat(False)))
    pb = map(new, repeat(Piece), zip(b, t.layers, t.modules, t.b_cols, t.out_dims, t.ranks, repeat(True)))
    pieces = list(chain.from_iterable(zip(pa, pb, strict=True)))
    return Placed(t.rank, t.rank_table, t.scaling_table, pieces)


@dataclass(frozen=True)
class _Template:
    layers: tuple[int, ...]
    modules: tuple[str, ...]
    a_cols: tuple[int, ...]
    in_dims: tuple[int, ...]
    b_cols: tuple[int, ...]
    out_dims: tuple[int, ...]
    ranks: tuple[int, ...]
    rank: int
    rank_table: list[list[int]]
    scaling_table: list[list[float]]


@lru_cache(maxsize=256)
def _template(exp: Expected, layout: LoraLayout) -> _Template:
    slots = _slots(layout)
    rows = [(layer, module, *slots[module], exp.rank_scaling[layer, module]) for layer, module in exp.modules]
    ranks = [[0] * NUM_SLICES for _ in range(layout.num_layers)]
    scalings = [[0.0] * NUM_SLICES for _ in range(layout.num_layers)]
    for layer, _, sid, *_, (r, scaling) in rows:
        ranks[layer][sid], scalings[layer][sid] = r, scaling
    return _Template(
        layers=tuple(row[0] for row in rows),
        modules=tuple(row[1] for row in rows),
        a_cols=tuple(row[3] for row in rows),
        in_dims=tuple(row[4] for row in rows),
        b_cols=tuple(row[5] for row in rows),
        out_dims=tuple(row[6] for row in rows),
        ranks=tuple(row[7][0] for row in rows),
        rank=max(row[7][0] for row in rows),
        rank_table=ranks,
        scaling_table=scalings,
    )
