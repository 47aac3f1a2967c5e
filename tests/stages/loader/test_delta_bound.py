"""The one-pass effective-delta check against a float64 reference computed module by module: it refuses
exactly the modules whose bound s * max_i ||B[i, :]|| * max_j ||A[:, j]|| passes the limit, names the
first such module, and treats rows past a module's own rank (zero in a packed block) as absent."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout
from stages.loader.adapter_config import AdapterError, delta_limit
from stages.loader.delta_bound import check_packed_deltas, column_sq_norms

LAYOUT = LoraLayout.build(num_layers=3, hidden=40, q_out=48, kv_out=20, intermediate=56, max_rank=24)


def _block(rank: int, ranks: torch.Tensor, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """A packed block with every module's rows past its own rank zeroed, as the writer leaves it."""
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(LAYOUT.num_layers, rank, LAYOUT.row_elems, generator=gen) * 0.05
    for layer in range(LAYOUT.num_layers):
        for sid, module in enumerate(TARGET_MODULES):
            g, i = LAYOUT.module_slot(module)
            r = int(ranks[layer, sid])
            a0, b0 = g.a_offset + i * g.in_stride, g.b_offset + g.out_offsets[i]
            block[layer, r:, a0 : a0 + g.in_dim] = 0
            block[layer, r:, b0 : b0 + g.out_dims[i]] = 0
    return block.to(dtype)


def _bounds(block: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor) -> dict[str, float]:
    """ "module of layer" -> float64 bound of every adapted module, in layer then module order."""
    out = {}
    for layer in range(block.shape[0]):
        for sid, module in enumerate(TARGET_MODULES):
            r = int(ranks[layer, sid])
            if r == 0:
                continue
            g, i = LAYOUT.module_slot(module)
            a0, b0 = g.a_offset + i * g.in_stride, g.b_offset + g.out_offsets[i]
            a = block[layer, :r, a0 : a0 + g.in_dim].double()  # [r, in]
            b = block[layer, :r, b0 : b0 + g.out_dims[i]].double().t()  # [out, r]
            s = float(scalings[layer, sid])
            out[f"{module} of layer {layer}"] = s * float(b.norm(dim=1).max()) * float(a.norm(dim=0).max())
    return out


def _over(block, ranks, scalings) -> list[str]:
    limit = {m: delta_limit(block.dtype, LAYOUT.module_slot(m)[0].in_dim) for m in TARGET_MODULES}
    return [w for w, bound in _bounds(block, ranks, scalings).items() if bound > limit[w.split()[0]]]


def _ranks(seed: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, rank + 1, (LAYOUT.num_layers, NUM_SLICES), generator=gen)
    ranks[0, 0] = rank  # the block's rank is some module's rank
    return ranks


def test_column_norms_equal_float64():
    ranks = _ranks(1, 13)
    block = _block(13, ranks, seed=1)
    got = column_sq_norms(block).double()
    want = block.double().square().sum(dim=1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("with_peak", [False, True], ids=["norms", "peak-first"])
@pytest.mark.parametrize("seed", range(6))
def test_refuses_exactly_the_modules_over_the_limit(seed, with_peak):
    """With the adapter's largest |value| given, the cheap first bound accepts what it can and the norms
    decide the rest: the outcome is the same as from the norms alone."""
    rank = [1, 5, 16, 24, 7, 11][seed]
    ranks = _ranks(seed, rank)
    gen = torch.Generator().manual_seed(100 + seed)
    # scalings spread so that some modules land on each side of the limit (bounds here are ~1e-1..1e1)
    scalings = 10 ** (torch.rand(LAYOUT.num_layers, NUM_SLICES, generator=gen) * 6)
    block = _block(rank, ranks, seed)
    peak = float(block.double().abs().max()) if with_peak else None
    over = _over(block, ranks, scalings)
    if not over:
        check_packed_deltas("x", LAYOUT, block, ranks, scalings, peak)
        return
    with pytest.raises(AdapterError) as info:
        check_packed_deltas("x", LAYOUT, block, ranks, scalings, peak)
    assert f"{over[0]}:" in str(info.value), (over, str(info.value))


def test_the_random_cases_cover_both_outcomes():
    """The parametrized cases above are not all on one side of the limit."""
    outcomes = set()
    for seed in range(6):
        rank = [1, 5, 16, 24, 7, 11][seed]
        ranks = _ranks(seed, rank)
        gen = torch.Generator().manual_seed(100 + seed)
        scalings = 10 ** (torch.rand(LAYOUT.num_layers, NUM_SLICES, generator=gen) * 6)
        outcomes.add(bool(_over(_block(rank, ranks, seed), ranks, scalings)))
    assert outcomes == {True, False}


def test_one_module_just_over_the_limit_is_refused_and_just_under_passes():
    ranks = _ranks(7, 8)
    layer, sid = 2, TARGET_MODULES.index("down_proj")
    ranks[layer, sid] = 8
    block = _block(8, ranks, seed=7)
    ones = torch.ones(LAYOUT.num_layers, NUM_SLICES)
    check_packed_deltas("x", LAYOUT, block, ranks, ones)
    unit = _bounds(block, ranks, ones)[f"down_proj of layer {layer}"]
    limit = delta_limit(block.dtype, LAYOUT.module_slot("down_proj")[0].in_dim)
    scalings = ones.clone()
    scalings[layer, sid] = 1.001 * limit / unit
    with pytest.raises(AdapterError, match=f"down_proj of layer {layer}: the effective delta"):
        check_packed_deltas("x", LAYOUT, block, ranks, scalings)
    scalings[layer, sid] = 0.999 * limit / unit
    check_packed_deltas("x", LAYOUT, block, ranks, scalings)


def test_entries_whose_squares_overflow_float32_are_judged_exactly():
    """A entries of 1e25 (squares past float32) with B of 1e-30: the exact bound is tiny and passes; with
    B of 1 it is refused (the fast pass cannot decide either, the exact check does)."""
    ranks = torch.zeros(LAYOUT.num_layers, NUM_SLICES, dtype=torch.int64)
    sid = TARGET_MODULES.index("q_proj")
    ranks[1, sid] = 2
    block = torch.zeros(LAYOUT.num_layers, 2, LAYOUT.row_elems, dtype=torch.float32)
    g, i = LAYOUT.module_slot("q_proj")
    a0, b0 = g.a_offset + i * g.in_stride, g.b_offset + g.out_offsets[i]
    block[1, :, a0 : a0 + g.in_dim] = 1e25
    block[1, :, b0 : b0 + g.out_dims[i]] = 1e-30
    assert math.isinf(float(column_sq_norms(block).max()))
    scalings = torch.ones(LAYOUT.num_layers, NUM_SLICES)
    check_packed_deltas("x", LAYOUT, block, ranks, scalings)
    block[1, :, b0 : b0 + g.out_dims[i]] = 1.0
    with pytest.raises(AdapterError, match="q_proj of layer 1"):
        check_packed_deltas("x", LAYOUT, block, ranks, scalings)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_scalings_are_refused(bad):
    ranks = _ranks(3, 4)
    block = _block(4, ranks, seed=3)
    scalings = torch.ones(LAYOUT.num_layers, NUM_SLICES)
    scalings[0, 0] = bad
    with pytest.raises(AdapterError, match="q_proj of layer 0"):
        check_packed_deltas("x", LAYOUT, block, ranks, scalings)


def test_the_plan_notes_the_largest_value_of_the_file(tiny_llama, llama_adapters):
    """The writer's value checks see every value: the plan's peak is the file's largest |value| (read
    independently with the safetensors library), for float32 files packed into bfloat16 and float32."""
    from safetensors.torch import load_file

    from runtime.common.model_config import ModelConfig
    from stages.loader.adapter_reader import plan_adapter
    from stages.loader.block_writer import write_all

    cfg = ModelConfig.from_dir(tiny_llama)
    for name, path in llama_adapters.items():
        want = max(
            float(t.double().abs().max()) for t in load_file(path / "adapter_model.safetensors").values()
        )
        for dtype in (torch.bfloat16, torch.float32):
            layout = LoraLayout.for_model(cfg, 16)
            with plan_adapter(name, path, cfg, layout, dtype) as plan:
                write_all(plan, torch.empty(plan.shape, dtype=dtype))
            assert plan.peak == pytest.approx(want, rel=1e-6), (name, dtype)
