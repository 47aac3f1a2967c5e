"""bench_lora_step on the CPU (interpreter) or a GPU (timings mean nothing here): the step it builds is
what the runner would launch (tokens ordered by adapter id, every adapter present), the pool holds each
adapter's rank rows at distinct rows, and every kind of preparation it times (eager, graphed at the
16-token tile with the runner's bound, a replaced kernel config) computes the float64 reference's
delta."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from benchmarks import bench_lora_step as bls
from kernels import device_info
from kernels.batch_info import plan_runs, plan_tiles
from kernels.lora_expand import ExpandConfig
from kernels.lora_shrink import ShrinkConfig
from stages.worker.lora.triton_backend import TritonLoraBackend

pytestmark = pytest.mark.timeout(120)
# The real kernels where there is a GPU (the root conftest sets the interpreter only where there is none).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _setup(ranks=(1, 5, 16, 3), n_ad=5, decodes=9, prefill=(20, 7)):
    layout = bls.layout_for("tiny", max(ranks))
    pool, adapter_ranks = bls.make_pool(layout, 1 << 20, n_ad, list(ranks), DEVICE, seed=3)
    indptr, slots = bls.make_step(n_ad, decodes, list(prefill), seed=3)
    return layout, pool, adapter_ranks, indptr, slots


def _buffers(layout, bucket):
    """Layer 0's inputs and outputs of every group (what `check` reads), `bucket` token rows."""
    xs = [
        {g.name: torch.randn((bucket, g.in_dim), dtype=torch.bfloat16, device=DEVICE) for g in layout.groups}
    ]
    outs = [
        {
            g.name: torch.zeros((bucket, g.out_total), dtype=torch.bfloat16, device=DEVICE)
            for g in layout.groups
        }
    ]
    return xs, outs


def test_step_is_ordered_by_adapter_and_pool_rows_are_distinct():
    layout, pool, ranks, indptr, slots = _setup()
    assert slots == sorted(slots) and set(slots) == set(range(5))
    lengths = np.diff(indptr)
    assert indptr[-1] == 9 + 20 + 7 and sorted(lengths.tolist()).count(1) == 9
    assert ranks == [1, 5, 16, 3, 1]
    rows = [pool.host_rows[i, :r].tolist() for i, r in enumerate(ranks)]
    flat = [x for r in rows for x in r]
    assert len(flat) == len(set(flat)) == sum(ranks)  # no two adapters share a rank row
    assert all(0 <= x < pool.total_rows for x in flat)
    assert int(pool.host_ranks[2, 0, 0]) == 16 and float(pool.host_scalings[2, 0, 0]) == 2.0


def test_floor_counts_each_adapter_once_and_activations_per_token():
    layout, _, ranks, _, _ = _setup()
    one = bls.floor_bytes(layout, 10, ranks)
    assert bls.floor_bytes(layout, 10, ranks + ranks) > one  # more distinct adapters: more bytes
    assert bls.floor_bytes(layout, 20, ranks) > one


@pytest.mark.parametrize(
    "variant", ["eager", "graphed", "graphed, shrink split 2", "graphed, shrink split 2 reduced"]
)
def test_each_prepared_variant_matches_float64(variant):
    layout, pool, _, indptr, slots = _setup()
    backend = TritonLoraBackend(pool, max_tokens=64, max_seqs=16)
    bucket = 48
    xs, outs = _buffers(layout, bucket)
    if variant == "eager":
        backend.prepare(indptr, slots)
    else:
        backend.prepare(indptr, slots, pad_to=bucket, block_m=16)
        assert backend.batch_info.num_tiles == min(bucket, bucket // 16 + min(16, pool.num_ids))
    info = backend.batch_info
    configs = backend.configs_for(info)
    if "split 2" in variant:
        reduce = variant.endswith("reduced")
        sc = ShrinkConfig(block_n=16, block_k=128, split_k=2, num_warps=4, num_stages=3, reduce=reduce)
        configs = {
            k: bls.with_configs(backend, info, layout.group(k), s, e, v, sc, None)
            for k, (s, e, v) in configs.items()
        }
        # The expand reads the two partials, or their sum
        assert all(s.split_k == 2 and v.shape[0] == (1 if reduce else 2) for s, _, v in configs.values())
    err, _ = bls.check(backend, info, configs, xs, outs, layout, pool, indptr, slots)
    assert err < 1e-2, err  # bf16 rounding of the delta, against float64


def test_a_swept_config_keeps_the_heuristics_dependent_launch(monkeypatch):
    """Where the heuristics launch the kernels as programmatic dependents (as on Hopper), a swept block
    shape keeps that choice: a sweep compares shapes, not launch orders."""
    monkeypatch.setattr(device_info, "pdl", lambda device: True)
    layout, pool, _, indptr, slots = _setup()
    backend = TritonLoraBackend(pool, max_tokens=64, max_seqs=16)
    backend.prepare(indptr, slots)
    info = backend.batch_info
    for name, (s, e, v) in backend.configs_for(info).items():
        assert s.pdl
        swept = bls.with_configs(
            backend, info, layout.group(name), s, e, v, ShrinkConfig(16, 128, 2), ExpandConfig(64, 16)
        )
        assert swept[0].pdl and swept[1].pdl and swept[0].split_k == 2 and swept[1].block_n == 64, name


def test_a_tile_bound_below_the_steps_tiles_is_caught():
    """The tool's "bound = its tiles" rows use the step's own tile count: one tile fewer would leave
    tokens without their delta, and the float64 check sees it."""
    layout, pool, _, indptr, slots = _setup()
    backend = TritonLoraBackend(pool, max_tokens=64, max_seqs=16)
    bucket = 48
    xs, outs = _buffers(layout, bucket)
    own = plan_tiles(plan_runs(indptr, slots), 16).shape[0]
    backend.prepare(indptr, slots, pad_to=bucket, block_m=16)
    short = dataclasses.replace(backend.batch_info, num_tiles=own - 1)
    err, _ = bls.check(backend, short, backend.configs_for(short), xs, outs, layout, pool, indptr, slots)
    assert err > 1e-2


def test_main_times_only_the_chosen_variants_and_reports_them(tmp_path):
    out = tmp_path / "step.json"
    args = ["--smoke", "--adapters", "4", "--decodes", "6", "--prefill", "20", "--max-seqs", "8"]
    bls.main([*args, "--only", "graphed bm16 (bound", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["distinct"] == 4 and report["tokens"] == 26 and report["bucket"] == 32
    names = [r["variant"] for r in report["rows"]]
    assert names and all("graphed bm16 (bound" in n for n in names)
    assert all(r["err"] < 1e-2 and r["block_m"] == 16 for r in report["rows"])
    with pytest.raises(SystemExit, match="matches no variant"):
        bls.main([*args, "--only", "no such variant"])


def test_act_modes_time_each_variant_fused_and_unfused(tmp_path):
    """--act both: every chosen variant twice, with the gate_up activation after the expand and fused into
    it (a step of more tokens than the backend's 256-sequence default, so it fuses), each delta checked."""
    out = tmp_path / "act.json"
    args = ["--smoke", "--adapters", "4", "--decodes", "6", "--prefill", "300", "--max-seqs", "8"]
    bls.main([*args, "--only", "graphed bm16 (bound = its", "--act", "both", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    names = [r["variant"] for r in rows]
    assert names == [
        "graphed bm16 (bound = its 22 tiles), act unfused",
        "graphed bm16 (bound = its 22 tiles), act fused",
    ]
    assert all(r["err"] < 1e-2 for r in rows)


def test_main_with_an_8bit_pool_checks_the_dequantized_delta(tmp_path):
    """--lora-dtype fp8: the pool's rows are e4m3, the graphed step's delta matches the float64 reference
    of the dequantized rows (int8 runs the same code: tests/kernels/test_lora_fp8.py), and the floor
    counts one byte an element of adapter rows and 4 a scale."""
    args = ["--smoke", "--adapters", "4", "--decodes", "6", "--prefill", "20", "--max-seqs", "8"]
    bls.main(
        [*args, "--only", "graphed bm16 (bound", "--lora-dtype", "fp8", "--out", str(tmp_path / "q.json")]
    )
    q = json.loads((tmp_path / "q.json").read_text())
    assert q["rows"] and all(r["err"] < 1e-2 for r in q["rows"])
    layout = bls.layout_for("tiny", 16)
    two, one = (bls.floor_bytes(layout, 10, [4, 16], elt) for elt in (2, 1))
    rows = sum(g.num_slices * g.in_dim + g.out_total for g in layout.groups) * 20 * layout.num_layers
    scales = sum(8 * g.num_slices for g in layout.groups) * 20 * layout.num_layers
    assert two - one == rows - scales
