"""TritonLoraBackend against TorchLoraBackend on a rank-paged LoraPool loaded with random adapters (all
four groups, stale NaN rows past every rank and in the free rows, each adapter in several out-of-order
runs of rows), the tile planner, and (GPU only) a mixed batch with sync debug on."""

from __future__ import annotations

import pytest
import torch

from kernels.batch_info import BatchInfoBuilder, plan_runs, plan_tiles
from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout
from runtime.common.packed import PackedAdapter
from stages.worker.lora.factory import make_backend
from stages.worker.lora.pool import LoraPool
from stages.worker.lora.triton_backend import TritonLoraBackend
from tests.kernels.conftest import (
    MIXED_LENGTHS,
    MIXED_SLOTS,
    TOL,
    indptr_of,
    rel_err,
    small_layout,
)

ADAPTER_RANKS = [1, 7, 24, 16]  # id i holds a rank-ADAPTER_RANKS[i] adapter; id 4 stays empty


def _scattered_runs(gen: torch.Generator, total: int, ranks: list[int]) -> list[list[tuple[int, int]]]:
    """Each adapter's rows as runs of 1-5 rows at random free places of the pool, in random order."""
    free = torch.randperm(total, generator=gen).tolist()
    out = []
    for r in ranks:
        rows, runs = sorted(free[:r], reverse=True), []
        free = free[r:]
        for row in rows:  # descending rows: runs come out of order
            if runs and runs[-1][0] == row + 1 and runs[-1][1] < 5:
                runs[-1] = (row, runs[-1][1] + 1)
            else:
                runs.append((row, 1))
        out.append(runs)
    return out


def loaded_pool(layout: LoraLayout, dtype: torch.dtype, device: torch.device, seed: int) -> LoraPool:
    gen = torch.Generator().manual_seed(seed)
    slots = LoraPool(layout, sum(ADAPTER_RANKS) + 9, 5, dtype, device)  # 9 rows never written
    slots.mem.fill_(float("nan"))  # never-written rows: stale garbage
    all_runs = _scattered_runs(gen, slots.total_rows, ADAPTER_RANKS)
    for slot, rank in enumerate(ADAPTER_RANKS):
        block = torch.randn((layout.num_layers, rank, layout.row_elems), generator=gen)  # [L, r, row]
        ranks = torch.randint(0, rank + 1, (layout.num_layers, NUM_SLICES), generator=gen, dtype=torch.int32)
        ranks[:, 0] = rank
        ranks[0, 3] = 0  # one module not targeted in one layer
        for layer in range(layout.num_layers):  # rows past a module's own rank are stale too
            for sid, module in enumerate(TARGET_MODULES):
                g, i = layout.module_slot(module)
                r = int(ranks[layer, sid])
                block[layer, r:, g.a_offset + i * g.in_stride : g.a_offset + i * g.in_stride + g.in_dim] = (
                    float("nan")
                )
                block[
                    layer, r:, g.b_offset + g.out_offsets[i] : g.b_offset + g.out_offsets[i] + g.out_dims[i]
                ] = float("nan")
        scalings = torch.rand((layout.num_layers, NUM_SLICES), generator=gen) + 0.5
        slots.load(slot, PackedAdapter(f"a{slot}", block.to(dtype), ranks, scalings), all_runs[slot])
    return slots


def load_full_rank(pool: LoraPool, slot: int, rank: int, runs, gen: torch.Generator, std: float) -> None:
    """Load adapter `slot` into `runs`: every module at `rank` in every layer, scaling 2, rows drawn
    from N(0, std) and rounded to the pool's dtype."""
    L = pool.layout.num_layers
    block = (torch.randn((L, rank, pool.layout.row_elems), generator=gen) * std).to(pool.dtype)
    ranks = torch.full((L, NUM_SLICES), rank, dtype=torch.int32)
    pool.load(slot, PackedAdapter(f"a{slot}", block, ranks, torch.full((L, NUM_SLICES), 2.0)), runs)


def compare_backends(
    slots: LoraPool,
    indptr: list[int],
    seg_slots: list[int],
    seed: int,
    tri_backend=None,
    pad_to=None,
    tile_class=None,
) -> None:
    """`tri_backend` (default: one on the slots themselves) against the torch backend on `slots`."""
    gen = torch.Generator().manual_seed(seed)
    layout = slots.layout
    ref_backend = make_backend("torch", slots, max_tokens=128)
    tri_backend = tri_backend or make_backend("triton", slots, max_tokens=128)
    assert tri_backend.name == "triton"
    T = indptr[-1]
    no_adapter = torch.ones(T, dtype=torch.bool)
    for i, s in enumerate(seg_slots):
        if s >= 0:
            no_adapter[indptr[i] : indptr[i + 1]] = False
    ref_backend.prepare(indptr, seg_slots)
    tri_backend.prepare(indptr, seg_slots, pad_to=pad_to, tile_class=tile_class)
    T = pad_to or T
    no_adapter = torch.cat([no_adapter, torch.ones(T - no_adapter.shape[0], dtype=torch.bool)])
    for layer in range(layout.num_layers):
        for g in layout.groups:
            x = torch.randn((T, g.in_dim), generator=gen).to(slots.dtype).to(slots.device)
            out0 = torch.randn((T, g.out_total), generator=gen).to(slots.dtype).to(slots.device)
            want, got = out0.clone(), out0.clone()
            ref_backend.apply(x[: indptr[-1]], want[: indptr[-1]], layer, g)
            tri_backend.apply(x, got, layer, g)
            assert torch.isfinite(got).all(), (layer, g.name)
            assert torch.equal(got[no_adapter.to(got.device)], out0[no_adapter.to(got.device)])
            err = rel_err((got - out0).cpu(), (want - out0).cpu())
            assert err < 2 * TOL[slots.dtype], (layer, g.name, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_matches_torch_mixed_batch(device, dtype):
    slots = loaded_pool(small_layout(), dtype, device, seed=7)
    compare_backends(slots, indptr_of(MIXED_LENGTHS), MIXED_SLOTS, seed=1)


def test_backend_successive_batches(device):
    """Decode (one token per adapter) after prefill: the fixed device buffers are rewritten each time."""
    slots = loaded_pool(small_layout(), torch.bfloat16, device, seed=8)
    compare_backends(slots, indptr_of(MIXED_LENGTHS), MIXED_SLOTS, seed=2)
    compare_backends(slots, indptr_of([1] * 7), [3, 0, -1, 1, 2, 4, 0], seed=3)
    compare_backends(slots, indptr_of([2, 3]), [-1, -1], seed=4)  # base only: nothing launched


def test_backend_reads_the_pool_through_its_row_table(device):
    pool = loaded_pool(small_layout(), torch.float32, device, seed=12)
    backend = make_backend("triton", pool, max_tokens=16)
    assert backend.rows is pool.rows  # the pool's own table, never a copy (graphs hold its address)
    assert pool.rows.dtype == torch.int32 and tuple(pool.rows.shape) == (5, pool.layout.max_rank)
    # a padded decode batch replays on the same views and table
    compare_backends(pool, indptr_of([1] * 5), [3, 0, -1, 2, 1], seed=2, tri_backend=backend, pad_to=8)


def test_padded_tile_bound_counts_runs_of_at_most_max_seqs_sequences(device):
    """A padded (graphed) batch's grid covers pad_to // block_m tiles plus one per run, and runs are at
    most min(pool ids, sequences a forward holds): a batch at exactly that bound is computed whole
    (every tile launched), and one past it is refused, naming the bound."""
    pool = loaded_pool(small_layout(), torch.float32, device, seed=13)  # 5 ids
    backend = make_backend("triton", pool, max_tokens=64, max_seqs=3)
    # 3 sequences (runs) of 17 + 1 + 17 tokens: 2 + 1 + 2 = 5 tiles of 16 = 40 // 16 + 3
    compare_backends(pool, indptr_of([17, 1, 17]), [0, 1, 2], seed=5, tri_backend=backend, pad_to=40)
    assert backend.batch_info.num_tiles == 40 // 16 + 3
    unbounded = make_backend("triton", pool, max_tokens=64)  # runs bounded by the ids (5) alone
    unbounded.prepare(indptr_of([17, 1, 17]), [0, 1, 2], pad_to=40, block_m=16)
    assert unbounded.batch_info.num_tiles == 40 // 16 + 5
    with pytest.raises(ValueError, match="exceed the padded bound 5"):
        backend.prepare(indptr_of([17, 1, 17, 1]), [0, 1, 2, 3], pad_to=40, block_m=16)


def test_planner_merges_and_splits():
    runs = plan_runs([0, 2, 2, 5, 9, 10, 30], [3, 1, 3, 3, -1, 0])
    # the empty slot-1 segment is dropped, so slot 3's three segments merge into one run
    assert [r.tolist() for r in runs] == [[0, 10], [9, 30], [3, 0]]
    tiles = plan_tiles(runs, 16)
    assert tiles[:, :3].tolist() == [[0, 9, 3], [10, 26, 0], [26, 30, 0]]
    info = BatchInfoBuilder(64, "cpu").build([0, 2, 2, 5, 9, 10, 30], [3, 1, 3, 3, -1, 0], 5)
    assert (info.num_tiles, info.max_len, info.block_m, info.block_rank) == (3, 20, 16, 16)
    # Column 3 of rows 1-2: the one adapter of rows 0-15 (none: slots 3, base and 0) and 16-29 (slot 0).
    assert info.meta[:4].tolist() == [[3, 30, 20, 16], [0, 9, 3, -1], [10, 26, 0, 0], [26, 30, 0, 0]]
    assert info.row_blocks == 2
    assert BatchInfoBuilder(1024, "cpu").build([0, 600, 700], [1, 2], 64).block_m == 64  # prefill-sized
    with pytest.raises(ValueError, match="max_tokens"):
        BatchInfoBuilder(8, "cpu").build([0, 9], [0], 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_backend_no_sync_on_gpu():
    device = torch.device("cuda")
    slots = loaded_pool(small_layout(), torch.bfloat16, device, seed=9)
    backend = make_backend("triton", slots, max_tokens=128)
    indptr, seg_slots = indptr_of(MIXED_LENGTHS), MIXED_SLOTS
    xs = {
        g.name: torch.randn((indptr[-1], g.in_dim), device=device, dtype=slots.dtype)
        for g in slots.layout.groups
    }
    outs = {
        g.name: torch.zeros((indptr[-1], g.out_total), device=device, dtype=slots.dtype)
        for g in slots.layout.groups
    }
    backend.prepare(indptr, seg_slots)  # warm-up: compiles the kernels
    for g in slots.layout.groups:
        backend.apply(xs[g.name], outs[g.name].clone(), 0, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):  # laps the pinned ring
            backend.prepare(indptr, seg_slots)
            for layer in range(slots.layout.num_layers):
                for g in slots.layout.groups:
                    backend.apply(xs[g.name], outs[g.name], layer, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for out in outs.values():
        assert torch.isfinite(out).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rank", [16, 64])
def test_backend_llama_shapes_on_gpu(rank):
    """Real Llama-3-8B widths (vectorised loads, wide tiles) on a decode and a prefill batch."""
    layout = LoraLayout.build(
        num_layers=1, hidden=4096, q_out=4096, kv_out=1024, intermediate=14336, max_rank=64
    )
    slots = LoraPool(layout, 8 * 64, 8, torch.bfloat16, torch.device("cuda"))
    gen = torch.Generator().manual_seed(rank)
    for slot in range(8):
        runs = [((7 - slot) * 64, rank // 2), (slot * 64 + 32, rank - rank // 2)]  # two runs, interleaved
        load_full_rank(slots, slot, rank, runs, gen, std=0.05)
    compare_backends_big(slots, indptr_of([1] * 48), [i % 8 for i in range(48)])
    compare_backends_big(slots, indptr_of([300, 1, 700, 24]), [2, -1, 5, 1])


def compare_backends_big(slots: LoraPool, indptr: list[int], seg_slots: list[int]) -> None:
    ref_backend = make_backend("torch", slots, max_tokens=2048)
    tri_backend = make_backend("triton", slots, max_tokens=2048)
    ref_backend.prepare(indptr, seg_slots)
    tri_backend.prepare(indptr, seg_slots)
    for g in slots.layout.groups:
        x = torch.randn((indptr[-1], g.in_dim), device="cuda", dtype=slots.dtype)
        out0 = torch.randn((indptr[-1], g.out_total), device="cuda", dtype=slots.dtype)
        want, got = out0.clone(), out0.clone()
        ref_backend.apply(x, want, 0, g)
        tri_backend.apply(x, got, 0, g)
        assert rel_err(got - out0, want - out0) < 2 * TOL[slots.dtype], g.name


def rank8_pool(layout: LoraLayout, loaded: int, device, seed: int) -> LoraPool:
    """A float32 pool of 40 ids of 8 rows each (one layer), ids below `loaded` holding rank-8 adapters."""
    pool = LoraPool(layout, 40 * 8, 40, torch.float32, device)
    gen = torch.Generator().manual_seed(seed)
    for slot in range(loaded):
        load_full_rank(pool, slot, 8, [(slot * 8, 8)], gen, std=0.1)
    return pool


def test_decode_batches_take_the_tile_class_of_their_own_tiles(device, monkeypatch):
    """A padded batch's kernel configs follow its tile class: the first of `tile_classes` with at least
    2/3 of its tiles, else the bound. Each class computes the same delta as the torch backend, and on an
    H100's SM count a few-tile class splits the shrink's K where the bound's configs do not."""
    from kernels import device_info

    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)  # an H100's count
    layout = LoraLayout.build(num_layers=1, hidden=512, q_out=512, kv_out=128, intermediate=1024, max_rank=8)
    pool = rank8_pool(layout, 6, device, seed=11)
    tri = TritonLoraBackend(pool, max_tokens=64, max_seqs=64)
    assert tri.tile_classes(64) == (32, 44)  # bound: 40 ids + 64 // 16 full tiles
    indptr, seg_slots = indptr_of([1] * 6), list(range(6))
    tri.prepare(indptr, seg_slots, pad_to=64, tile_class="auto")
    assert tri.tile_class == 32
    few = {name: sc for name, (sc, _, _) in tri._configs.items()}
    tri.prepare(indptr_of([1] * 40), list(range(40)), pad_to=64, tile_class="auto")
    assert tri.tile_class == 32  # 40 tiles <= 48
    tri.prepare(indptr_of([1] * 44), list(range(40)) + [0] * 4, pad_to=64, tile_class="auto")
    assert tri.tile_class == 32  # adjacent tokens of one adapter merge: 40 tiles
    with pytest.raises(ValueError, match="tile class 7"):
        tri.prepare(indptr, seg_slots, pad_to=64, tile_class=7)
    tri.prepare(indptr, seg_slots, pad_to=64)  # the bound's configs
    assert tri.tile_class == 44
    bound = {name: sc for name, (sc, _, _) in tri._configs.items()}
    assert any(few[n].split_k > bound[n].split_k for n in few)
    for tile_class in (32, 44):
        compare_backends(
            pool, indptr, seg_slots, seed=tile_class, tri_backend=tri, pad_to=64, tile_class=tile_class
        )


def test_a_tile_class_grid_covers_one_and_a_half_times_its_count(device):
    """A class c below the bound launches grids of 1.5 c tiles, not the bound's: a batch of exactly 1.5 c
    tiles is computed whole (every tile's delta against the torch backend), one with more is refused."""
    layout = LoraLayout.build(num_layers=1, hidden=64, q_out=64, kv_out=32, intermediate=96, max_rank=8)
    pool = rank8_pool(layout, 40, device, seed=12)
    tri = TritonLoraBackend(pool, max_tokens=256, max_seqs=64)
    assert tri.tile_classes(256) == (32, 56)  # bound: 40 ids + 256 // 16 full tiles
    # Adapter 0's 129 tokens are 9 tiles, 39 one-token adapters one each: 48 tiles.
    indptr, seg_slots = indptr_of([129] + [1] * 39), list(range(40))
    compare_backends(pool, indptr, seg_slots, seed=3, tri_backend=tri, pad_to=256, tile_class="auto")
    assert (tri.tile_class, tri.batch_info.num_tiles) == (32, 48)
    tri.prepare(indptr, seg_slots, pad_to=256)  # the bound's class: the bound's grid
    assert (tri.tile_class, tri.batch_info.num_tiles) == (56, 56)
    more = indptr_of([145] + [1] * 39)  # 10 + 39 tiles
    tri.prepare(more, seg_slots, pad_to=256, tile_class="auto")
    assert tri.tile_class == 56
    with pytest.raises(ValueError, match="49 LoRA tiles exceed tile class 32's grid of 48"):
        tri.prepare(more, seg_slots, pad_to=256, tile_class=32)


def test_a_backend_without_tile_classes_never_reports_class_0(device):
    """Graph keys use class 0 for a batch without adapters: a backend whose launches ignore the tile
    count reports one class, 1, so a batch with adapters can never be keyed (and run) as adapter-free."""
    slots = loaded_pool(small_layout(), torch.float32, device, seed=3)
    backend = make_backend("torch", slots, max_tokens=64)
    assert backend.tile_classes(48) == (1,)
    backend.prepare(indptr_of([1] * 4), [0, 1, 2, 3], pad_to=48, tile_class="auto")
    assert backend.tile_class == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_act_fuses_batches_of_more_tokens_than_sequences(device, dtype):
    """`apply_act` against the torch backend's delta then torch's activation: a batch of more tokens than
    `max_seqs` (eager and padded) runs the fused kernel, a decode batch the plain expand; both give
    silu(gate + delta) * (up + delta)."""
    from kernels.lora_expand_act import ExpandActConfig
    from stages.worker.model.pointwise import TorchPointwise

    pool = loaded_pool(small_layout(), dtype, device, seed=21)
    layout = pool.layout
    g = layout.group("gate_up")
    tri = make_backend("triton", pool, max_tokens=128, max_seqs=8)
    ref = make_backend("torch", pool, max_tokens=128)
    gen = torch.Generator().manual_seed(5)
    cases = [
        (indptr_of([40, 1, 1, 20, 3]), [0, 1, 2, 3, -1], None, True),
        (indptr_of([40, 1, 1, 20, 3]), [0, 1, 2, 3, -1], 96, True),  # a step graph's padded batch
        (indptr_of([1] * 6), [3, 0, -1, 1, 2, 0], 8, False),  # a decode graph's: no more tokens than seqs
    ]
    for indptr, seg_slots, pad_to, fused in cases:
        tri.prepare(indptr, seg_slots, pad_to=pad_to)
        ref.prepare(indptr, seg_slots)
        info = tri.batch_info
        assert isinstance(tri.configs_for(info)["gate_up"][1], ExpandActConfig) == fused
        T, n = pad_to or indptr[-1], indptr[-1]
        for layer in range(layout.num_layers):
            x = torch.randn((T, g.in_dim), generator=gen).to(dtype).to(device)
            gate_up = torch.randn((T, g.out_total), generator=gen).to(dtype).to(device)
            want = gate_up.clone()
            ref.apply(x[:n], want[:n], layer, g)
            want = TorchPointwise.act(want.double())
            got = tri.apply_act(x, gate_up.clone(), layer, g, TorchPointwise.act)
            assert got.shape == want.shape and torch.isfinite(got).all()
            assert rel_err(got.cpu(), want.cpu()) < 2 * TOL[dtype], (indptr, layer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dependent_launches_in_a_graph_match_torch_every_replay():
    """On Hopper the shrink and expands launch as programmatic dependents (`device_info.pdl`): each may
    start while the kernel before it runs and must wait before reading what that kernel wrote. A graph
    of the model's order (each group's GEMM, then its shrink and expand; gate_up through the fused
    activation) over 1B widths and mixed ranks is replayed 20 times: every replay equals the first bit
    for bit, and the first equals the torch backend's delta and activation."""
    from kernels import device_info
    from kernels.silu_mul import silu_mul

    device = torch.device("cuda")
    assert device_info.pdl(device) == (torch.cuda.get_device_capability(device)[0] >= 9)
    layout = LoraLayout.build(
        num_layers=2, hidden=2048, q_out=2048, kv_out=512, intermediate=8192, max_rank=64
    )
    ranks_of = [8, 64, 16, 32, 64, 8, 32, 16]
    pool = LoraPool(layout, sum(ranks_of), len(ranks_of), torch.bfloat16, device)
    gen = torch.Generator().manual_seed(21)
    row = 0
    for slot, rank in enumerate(ranks_of):
        load_full_rank(pool, slot, rank, [(row, rank)], gen, std=0.05)
        row += rank
    lengths = [1] * 96 + [300, 37]
    seg_slots = [i % 8 for i in range(96)] + [1, 4]
    indptr = indptr_of(lengths)
    T = indptr[-1]
    tri = TritonLoraBackend(pool, max_tokens=512, max_seqs=128)
    ref = make_backend("torch", pool, max_tokens=512)
    tri.prepare(indptr, seg_slots)
    ref.prepare(indptr, seg_slots)
    xs = {g.name: torch.randn((T, g.in_dim), device=device, dtype=torch.bfloat16) for g in layout.groups}
    ws = {
        g.name: torch.randn((g.out_total, g.in_dim), device=device, dtype=torch.bfloat16) * 0.02
        for g in layout.groups
    }

    def forward(backend) -> list[torch.Tensor]:
        got = []
        for layer in range(layout.num_layers):
            for g in layout.groups:
                y = torch.nn.functional.linear(xs[g.name], ws[g.name])
                if g.name == "gate_up":
                    got.append(backend.apply_act(xs[g.name], y, layer, g, silu_mul))
                else:
                    backend.apply(xs[g.name], y, layer, g)
                    got.append(y)
        return got

    want = forward(ref)
    forward(tri)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = forward(tri)
    graph.replay()
    first = [t.clone() for t in got]
    base = [
        torch.nn.functional.linear(xs[g.name], ws[g.name])
        for _ in range(layout.num_layers)
        for g in layout.groups
    ]
    for i, (a, b, y0, g) in enumerate(zip(first, want, base, layout.groups * layout.num_layers, strict=True)):
        assert torch.isfinite(a).all(), (i, g.name)
        if g.name == "gate_up":  # the activation itself
            assert rel_err(a, b) < 2 * TOL[torch.bfloat16], (i, g.name, rel_err(a, b))
        else:  # the adapter delta on top of the GEMM
            assert rel_err(a - y0, b - y0) < 2 * TOL[torch.bfloat16], (i, g.name, rel_err(a - y0, b - y0))
    for n in range(20):
        graph.replay()
        for i, (a, b) in enumerate(zip(got, first, strict=True)):
            assert torch.equal(a, b), (n, i)


def test_dependent_launch_only_on_compiled_hopper_kernels_of_bounded_tiles(monkeypatch):
    """PDL is off on the CPU and under the interpreter, off with LORAPIPE_PDL=0, and a launch over more
    than PDL_MAX_TILES tiles keeps plain stream order even where it is on."""
    from kernels import device_info

    cpu = torch.device("cpu")
    assert not device_info.pdl(cpu)
    monkeypatch.setattr(device_info, "pdl", lambda device: True)
    assert device_info.pdl_for(cpu, device_info.PDL_MAX_TILES)
    assert not device_info.pdl_for(cpu, device_info.PDL_MAX_TILES + 1)
    monkeypatch.undo()
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        monkeypatch.setenv(device_info.PDL_ENV, "0")
        device_info.pdl.cache_clear()
        try:
            assert not device_info.pdl(cuda)
        finally:
            monkeypatch.undo()
            device_info.pdl.cache_clear()
