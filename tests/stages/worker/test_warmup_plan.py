"""The warm-up plan against brute force: `tile_range` against every way of cutting small batches into
adapter runs, the LoRA plan against the heuristics swept over every token count, longest run, tile count
and rank class of a small config (with a CPU's and an H100's SM count; bf16 pools as an H100 or H200 and
the CPU answer the heuristics, test_warmup_gpu.py's runner among them), the attention plan against the
choices of random real batches; and the warm-up does nothing on the CPU. What Triton specialises beyond
the configs: test_warmup_specs.py."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch

from kernels import device_info
from kernels.batch_info import BatchInfoBuilder, choose_block_m, plan_runs, plan_tiles
from kernels.fp8_gemm import MAX_M, choose_config
from kernels.lora_expand_act import ExpandActConfig
from kernels.lora_fused import FusedConfig
from kernels.paged_attention import choose_splits, decode_block_m, plan_blocks
from runtime.common.lora_layout import LoraLayout
from stages.worker.lora.pool import LoraPool
from stages.worker.lora.triton_backend import TritonLoraBackend
from stages.worker.model.linear import FP8, Fp8Weight
from stages.worker.model.weights import LayerWeights
from stages.worker.runner import ModelRunner, RunnerConfig
from stages.worker.warmup import warm_up
from stages.worker.warmup_plan import (
    attention_variants,
    block_m_spans,
    fp8_launches,
    lora_launches,
    plan_axes,
    rank_classes,
    tile_range,
)


def _compositions(total: int, parts: int):
    """Every tuple of `parts` positive run lengths summing to `total`."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


@pytest.mark.parametrize("block_m", [1, 2, 3, 4])
def test_tile_range_is_exactly_what_plan_tiles_can_make(block_m):
    slots = 3
    for tokens in range(1, 13):
        seen: dict[int, set[int]] = {}
        for adapter_tokens in range(1, tokens + 1):  # the rest are base-only tokens (no tiles)
            for runs in range(1, min(slots, adapter_tokens) + 1):
                for lengths in _compositions(adapter_tokens, runs):
                    indptr = [0, *itertools.accumulate(lengths), tokens]
                    tiles = plan_tiles(plan_runs(indptr, [*range(runs), -1]), block_m)
                    seen.setdefault(max(lengths), set()).add(len(tiles))
        for max_len, counts in seen.items():
            lo, hi = tile_range(tokens, max_len, block_m, slots)
            assert counts == set(range(lo, hi + 1)), (tokens, max_len, block_m)


def test_block_m_spans_give_choose_block_m_at_every_length():
    for t in [*range(1, 300), 511, 512, 513, 700, 1024]:
        spans = block_m_spans(t)
        assert spans[0][0] == 1 and spans[-1][1] == t
        assert all(b + 1 == c for (_, b, _), (c, _, _) in itertools.pairwise(spans))
        assert all(choose_block_m(ml, t) == bm for a, b, bm in spans for ml in range(a, b + 1))


# Projection widths (hidden, q_out, kv_out, intermediate): a 1B model's, so that split-K (bounded by in_dim)
# takes every value it can; the tiny llama preset's (test_warmup_gpu.py's model), where it cannot.
WIDE = (2048, 2048, 512, 8192)
TINY = (64, 64, 32, 160)


def _backend(
    max_tokens: int,
    max_rank: int = 24,
    slots: int = 3,
    lora_dtype: str = "auto",
    design: str = "serial",
    max_seqs: int | None = None,
    dtype: torch.dtype = torch.float32,
    dims: tuple[int, int, int, int] = WIDE,
    rows: int | None = None,
) -> TritonLoraBackend:
    """`slots` adapter ids over `rows` pool rows (`max_rank` each unless given)."""
    hidden, q_out, kv_out, inter = dims
    layout = LoraLayout.build(
        num_layers=1, hidden=hidden, q_out=q_out, kv_out=kv_out, intermediate=inter, max_rank=max_rank
    )
    pool = LoraPool(layout, rows or max_rank * slots, slots, dtype, torch.device("cpu"), lora_dtype)
    return TritonLoraBackend(pool, max_tokens, max_seqs, design=design)


# What the heuristics ask of the device: an H100's or H200's (132 SMs, 227 KiB of shared memory a
# program, dependent launches) and `device_info`'s answers for the CPU (4 SMs, no dependent launches).
DEVICES = {"hopper": (132, 232448, True), "cpu": (4, device_info.HOPPER_MAX_SHARED, False)}


def _as_device(monkeypatch, device: str) -> None:
    sms, smem, pdl = DEVICES[device]
    monkeypatch.setattr(device_info, "num_sms", lambda _device: sms)
    monkeypatch.setattr(device_info, "max_shared_memory", lambda _device: smem)
    monkeypatch.setattr(device_info, "pdl", lambda _device: pdl)


def _brute_force_keys(backend: TritonLoraBackend, padded: tuple[int | tuple[int, int], ...]) -> set[tuple]:
    """Every (group, block_m, block_rank, shrink config, expand config) the backend can pick, from every
    token count, longest adapter run and tile count, without the plan's shortcuts."""
    backend.prepare([0], [])
    empty = backend.batch_info
    num_slots = backend.pool.num_ids
    batches: set[tuple[int, int, int]] = set()
    for t in range(1, backend.max_tokens + 1):
        for max_len in range(1, t + 1):
            bm = choose_block_m(max_len, t)
            lo, hi = tile_range(t, max_len, bm, num_slots)
            batches.update((t, bm, tiles) for tiles in range(lo, hi + 1))
    infos = [
        empty.__class__(
            meta=empty.meta,
            num_tokens=t,
            num_tiles=tiles,
            block_m=bm,
            max_len=min(t, tiles * bm),
            block_rank=br,
            num_slots_used=1,
        )  # fmt: skip
        for t, bm, tiles in batches
        for br in rank_classes(backend.layout.max_rank)
    ]
    for spec in padded:  # a decode size: each of its tile classes; (tokens, token tile): the bound's
        size, block_m = spec if isinstance(spec, tuple) else (spec, None)
        for c in backend.tile_classes(size, block_m) if block_m is None else (None,):
            backend.prepare([0], [], pad_to=size, block_m=block_m, tile_class=c)
            infos.append(replace(backend.batch_info, num_tiles=backend.tile_class))
    keys = set()
    for info in infos:
        for name, (shrink, expand, _) in backend.configs_for(info).items():
            keys.add((name, info.block_m, info.block_rank, shrink, expand, backend.pool.mem.dtype))
    return keys


@pytest.mark.parametrize("sms", [4, 132])
@pytest.mark.parametrize("pdl", [False, True])
def test_lora_plan_is_exactly_what_the_heuristics_can_pick(sms, pdl, monkeypatch):
    """With `pdl`, as on Hopper: the configs say which launches are programmatic dependents (at most
    PDL_MAX_TILES tiles, made small here so that batches fall on both sides of it), and the plan holds
    both kinds of a variant where a config is reached from both sides."""
    monkeypatch.setattr(device_info, "num_sms", lambda device: sms)
    if pdl:
        monkeypatch.setattr(device_info, "pdl", lambda device: True)
        monkeypatch.setattr(device_info, "PDL_MAX_TILES", 20)
    backend = _backend(max_tokens=560)  # past 512 tokens: prefill-sized token tiles too
    padded = (1, 2, 4, 8, 16, 24)
    planned = [launch.key for launch in lora_launches(backend, padded)]
    assert len(planned) == len(set(planned)), "a variant planned twice"
    want = _brute_force_keys(backend, padded)
    assert set(planned) == want
    assert {k[1] for k in want} == {16, 64} and {k[2] for k in want} == {16, 32}
    assert len({k[3].split_k for k in want}) > 2, "split-K did not vary: the sweep is too small"
    assert {k[3].pdl for k in want} == {False, pdl} and {k[4].pdl for k in want} == {False, pdl}
    fused = [k[4] for k in want if isinstance(k[4], ExpandActConfig)]
    assert fused and all(e.expand.pdl == e.act.pdl for e in fused)  # the fused pair's two kernels agree
    if pdl:  # a shrink config reached on both sides of the bound is two variants, both planned
        below = {(k[0], k[1], k[2], replace(k[3], pdl=False)) for k in want if k[3].pdl}
        assert below & {(k[0], k[1], k[2], k[3]) for k in want if not k[3].pdl}


@pytest.mark.parametrize(
    "max_tokens,max_rank,slots,lora_dtype,design,max_seqs",
    [
        (261, 64, 40, "auto", "fused", 40),  # odd size; the fused design's token bound inside a split-K cap
        (517, 64, 5, "fp8", "serial", 24),  # past 512 tokens; e4m3 pool rows; few adapters (tile gaps)
        (191, 16, 300, "int8", "side", None),  # more adapters than tokens
        (130, 40, 2, "auto", "serial", 130),  # prefill fusion never reached (no batch passes max_seqs)
    ],
)
def test_fast_lora_plan_is_the_brute_force_sweep(
    max_tokens, max_rank, slots, lora_dtype, design, max_seqs, monkeypatch
):
    """The plan's shortcuts (token-count runs, bisected tile counts) against every token count, longest
    run, tile count and rank class, with decode and step graph sizes, on a Hopper-like device."""
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)
    monkeypatch.setattr(device_info, "pdl", lambda device: True)
    monkeypatch.setattr(device_info, "PDL_MAX_TILES", 24)
    backend = _backend(max_tokens, max_rank, slots, lora_dtype, design, max_seqs)
    padded = (1, 2, 4, 8, 16, 24, 32, 48, (64, 16), (max_tokens, 16))
    planned = [launch.key for launch in lora_launches(backend, padded)]
    assert len(planned) == len(set(planned)), "a variant planned twice"
    assert set(planned) == _brute_force_keys(backend, padded)
    for launch in lora_launches(backend, ()):  # each eager launch is a batch that serving can make
        t, bm, tiles = launch.num_tokens, launch.block_m, launch.num_tiles
        assert 1 <= t <= max_tokens and any(
            choose_block_m(ml, t) == bm
            and tile_range(t, ml, bm, slots)[0] <= tiles <= tile_range(t, ml, bm, slots)[1]
            for ml in range(1, t + 1)
        ), (t, bm, tiles)


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize(
    "case",
    [
        # test_warmup_gpu.py's runner (tiny llama, bf16, max rank 64, 64 running requests, its pool's
        # 2,995 ids) at 96 tokens a step (its 512 take a minute to sweep) with its decode graphs
        dict(max_tokens=96, max_rank=64, slots=2995, rows=4096, max_seqs=64, dims=TINY, graphs=32),
        # a 1B model's widths in bf16: the shrink's K step fitted to shared memory for 2-byte operands
        dict(max_tokens=160, max_rank=64, slots=24, max_seqs=48, dims=WIDE, graphs=24),
    ],
    ids=["gpu-test", "wide"],
)
def test_bf16_lora_plan_is_the_brute_force_sweep_on_each_device(device, case, monkeypatch):
    """The plan against the sweep with bf16 pools (the model's dtype on a GPU), as each device answers
    the heuristics, with the decode graphs' sizes and a step graph per token bucket."""
    _as_device(monkeypatch, device)
    case = dict(case)
    graphs = case.pop("graphs")
    backend = _backend(**case, dtype=torch.bfloat16)
    buckets = [b for b in (16, 32, 64, 128, 256) if b < backend.max_tokens] + [backend.max_tokens]
    padded = (*(b for b in (1, 2, 4, 8, 16, 24, 32) if b <= graphs), *((b, 16) for b in buckets))
    planned = [launch.key for launch in lora_launches(backend, padded)]
    assert len(planned) == len(set(planned)), "a variant planned twice"
    want = _brute_force_keys(backend, padded)
    assert set(planned) == want
    assert any(isinstance(k[4], ExpandActConfig) for k in want), "no prefill-sized batch: sweep too small"


def test_lora_plan_holds_the_side_design_launches(monkeypatch):
    """The side design launches in plain stream order (its shrink follows an event, its expand a join):
    its configs say so, so the plan compiles those variants, and no dependent ones."""
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)
    monkeypatch.setattr(device_info, "pdl", lambda device: True)
    backend = _backend(max_tokens=300, design="side")
    padded = (1, 8, 64)
    planned = [launch.key for launch in lora_launches(backend, padded)]
    assert set(planned) == _brute_force_keys(backend, padded)
    assert not any(k[3].pdl or k[4].pdl for k in planned)


def test_lora_plan_holds_the_fused_design_launches(monkeypatch):
    """With the one-launch design, batches without prefill runs plan the fused kernel's variants (and
    no separate shrink and expand for them); the others keep theirs."""
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)
    monkeypatch.setattr(device_info, "pdl", lambda device: True)
    backend = _backend(max_tokens=300, design="fused")
    padded = (1, 8, 16, 64)
    planned = [launch.key for launch in lora_launches(backend, padded)]
    assert len(planned) == len(set(planned)), "a variant planned twice"
    assert set(planned) == _brute_force_keys(backend, padded)
    fused = [k for k in planned if isinstance(k[4], FusedConfig)]
    assert fused and all(not k[3].reduce for k in fused)
    assert {
        launch.num_tokens <= 256
        for launch in lora_launches(backend, padded)
        if isinstance(launch.key[4], FusedConfig)
    } == {True}
    assert any(not isinstance(k[4], FusedConfig) for k in planned)  # prefill-sized batches: two launches


def test_lora_plan_names_the_pool_row_dtype():
    """An 8-bit pool's kernels are other variants (their SCALED constexpr, the row pointers' dtype): the
    plan's keys say which."""
    plain = {k[:5] for k in (launch.key for launch in lora_launches(_backend(max_tokens=64), (1, 2)))}
    for lora_dtype, want in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        keys = [
            launch.key for launch in lora_launches(_backend(max_tokens=64, lora_dtype=lora_dtype), (1, 2))
        ]
        assert {k[5] for k in keys} == {want} and {k[:5] for k in keys} == plain


@pytest.mark.parametrize("sms", [4, 132])
def test_attention_plan_holds_every_choice_of_real_batches(sms, monkeypatch):
    monkeypatch.setattr(device_info, "num_sms", lambda device: sms)
    heads, kv_heads, max_tokens, max_seqs, max_len = 8, 1, 512, 16, 4096
    planned = set(
        attention_variants(
            num_heads=heads, num_kv_heads=kv_heads, max_tokens=max_tokens, max_seqs=max_seqs,
            max_model_len=max_len, device="cpu",
        )
    )  # fmt: skip
    rng = random.Random(sms)
    chosen = set()
    for _ in range(400):
        n = rng.randint(1, max_seqs)
        q = [1 if rng.random() < 0.6 else rng.randint(1, max_tokens // n) for _ in range(n)]
        ctx = [rng.randint(qi, max_len) for qi in q]
        starts = list(itertools.accumulate([0, *q[:-1]]))
        meta, bm, most_keys = plan_blocks(starts, q, ctx, num_heads=heads, num_kv_heads=kv_heads)
        chosen.add((bm, choose_splits(meta.shape[0], kv_heads, most_keys, "cpu")))
    assert chosen <= planned
    assert len({s for _, s in chosen}) > 1 and len({b for b, _ in chosen}) > 1


@pytest.mark.parametrize(
    "sms,heads,kv_heads,max_tokens,max_seqs,max_len",
    [(132, 32, 8, 1000, 64, 2048), (4, 8, 1, 300, 16, 4096), (132, 16, 16, 777, 300, 1500)],
)
def test_attention_plan_is_the_sweep_over_every_block_count(
    sms, heads, kv_heads, max_tokens, max_seqs, max_len, monkeypatch
):
    """The bisected block counts against the splits of every block count and sampled key count."""
    monkeypatch.setattr(device_info, "num_sms", lambda device: sms)
    group = heads // kv_heads
    want = set()
    for bm in {decode_block_m(q * group) for q in range(1, max_tokens + 1)}:
        for blocks in range(1, -(-max_tokens * group // bm) + min(max_seqs, max_tokens) + 1):
            for keys in {1, max_len, *(x for p in range(1, 14) for x in (2**p - 1, 2**p, 2**p + 1))}:
                if keys <= max_len:
                    want.add((bm, choose_splits(blocks, kv_heads, keys, "cpu")))
    planned = attention_variants(
        num_heads=heads, num_kv_heads=kv_heads, max_tokens=max_tokens, max_seqs=max_seqs,
        max_model_len=max_len, device="cpu",
    )  # fmt: skip
    assert len(planned) == len(set(planned)) and set(planned) == want
    assert len({s for _, s in want}) > 1


@pytest.mark.parametrize("sms", [4, 132])
def test_fp8_plan_holds_each_config_of_every_token_count(sms):
    """Every projection with fp8 weights at every token count the weight-only GEMM serves gets its config
    planned once, on that projection; unquantized projections get none."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    ws = {k: torch.empty(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    for proj in ("gate_up", "down"):  # the plan reads the shapes only
        ws[proj] = Fp8Weight(torch.empty(shapes[proj], dtype=FP8), torch.empty(shapes[proj][0]))
    none = dict(qkv_bias=None, o_bias=None, gate_up_bias=None, down_bias=None)
    layer = LayerWeights(input_norm=None, post_norm=None, **ws, **none)
    plan = fp8_launches(layer, sms)
    keys = [(launch.proj, launch.config) for launch in plan]
    assert len(keys) == len(set(keys)) and {p for p, _ in keys} == {"gate_up", "down"}
    for proj in ("gate_up", "down"):
        n, k = shapes[proj]
        assert {c for p, c in keys if p == proj} == {choose_config(m, n, k, sms) for m in range(1, MAX_M + 1)}
    for launch in plan:
        n, k = shapes[launch.proj]
        assert choose_config(launch.num_tokens, n, k, sms) == launch.config


def test_warm_up_does_nothing_on_cpu(tiny_llama):
    runner = ModelRunner(
        RunnerConfig(model_dir=str(tiny_llama), dtype="float32", num_pages=16, lora_backend="triton")
    )
    stats = warm_up(runner)
    assert (stats.lora, stats.attention) == (0, 0) and stats.seconds < 0.1


def test_rank_classes_cover_every_rank_a_batch_can_have():
    """Brute force through the real batch builder: for every max rank up to 160, batches whose largest
    adapter has each rank 1..max get a rank tile that the plan holds and that covers that rank, and
    every class the plan holds is one such a batch gets (none compiled for nothing)."""
    builder = BatchInfoBuilder(8, "cpu")
    tile = {r: builder.build([0, 1], [0], r).block_rank for r in range(1, 161)}
    for max_rank in range(1, 161):
        classes = rank_classes(max_rank)
        assert all(tile[r] in classes and tile[r] >= r for r in range(1, max_rank + 1)), max_rank
        assert set(classes) == {tile[r] for r in range(1, max_rank + 1)}, max_rank
    assert rank_classes(8) == rank_classes(16) == [16] and rank_classes(64) == [16, 32, 64]


def test_plan_axes_count_what_the_plan_holds(monkeypatch):
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)
    launches = lora_launches(_backend(max_tokens=96, max_rank=40), (1, 8))
    line = plan_axes(launches, [(16, 1), (16, 2), (64, 1)])
    keys = [launch.key for launch in launches]
    assert f"block_rank {len({k[2] for k in keys})}{{16,32,64}}" in line
    assert (
        f"shrink config {len({k[3] for k in keys})}," in line
        and f"group {len({k[0] for k in keys})}," in line
    )
    assert line.endswith("attention axes: block_m 2{16,64}, key splits 2{1,2}")
