"""The Triton backend's designs on CUDA, as the model calls them (`begin` with a group's input, the base
projection, then `apply`): "side" (the shrink on a side stream beside the projection) as "serial" (the
same kernels, launched apart), "fused" (one launch a group) within bf16 rounding of it and of the torch
backend, eagerly and replayed from a CUDA graph several times (the fused launches' sync buffer left zero
by each); Llama-3-8B widths at ranks 16 and 80 (block rank 128); decode batches with base-only rows and
an empty adapter."""

from __future__ import annotations

import pytest
import torch

from runtime.common.lora_layout import LoraLayout
from stages.worker.graph_capture import recording
from stages.worker.lora.factory import make_backend
from stages.worker.lora.pool import LoraPool
from stages.worker.lora.triton_backend import TritonLoraBackend
from tests.kernels.conftest import TOL, indptr_of, rel_err
from tests.kernels.test_triton_backend import load_full_rank

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),  # a fused launch whose wait never ends fails here, not the whole run
]


def _pool(rank: int) -> LoraPool:
    layout = LoraLayout.build(
        num_layers=2, hidden=4096, q_out=4096, kv_out=1024, intermediate=14336, max_rank=max(rank, 16)
    )
    pool = LoraPool(layout, 6 * rank, 6, torch.bfloat16, torch.device("cuda"))
    gen = torch.Generator().manual_seed(rank)
    for slot in range(5):  # id 5 stays empty; each adapter's rows in two runs, the later one first
        half = rank // 2
        runs = [(slot * rank + half, rank - half), (slot * rank, half)] if half else [(slot * rank, rank)]
        load_full_rank(pool, slot, rank, runs, gen, std=0.05)
    return pool


def _step(backend, xs, base_ws, outs, layout) -> None:
    """Every layer's groups as the model runs them: begin, the projection (a real GEMM on the current
    stream, which a side-stream shrink must not race), the LoRA delta."""
    for layer in range(layout.num_layers):
        for g in layout.groups:
            x = xs[layer, g.name]
            backend.begin(x, layer, g)
            torch.matmul(x, base_ws[g.name], out=outs[layer, g.name])
            backend.apply(x, outs[layer, g.name], layer, g)


@pytest.mark.parametrize("rank", [16, 80])
@pytest.mark.parametrize("graphed", [False, True])
def test_designs_agree_on_decode_batches(rank, graphed):
    pool = _pool(rank)
    layout, dev = pool.layout, torch.device("cuda")
    seqs = [i % 7 - 1 for i in range(48)]  # ids -1 (base-only) to 5 (empty), sorted below
    seg_slots = sorted(seqs)
    indptr = indptr_of([1] * len(seg_slots))
    pad_to = 56
    gen = torch.Generator(device=dev).manual_seed(1)
    xs = {
        (layer, g.name): torch.randn((pad_to, g.in_dim), generator=gen, device=dev, dtype=torch.bfloat16)
        for layer in range(layout.num_layers)
        for g in layout.groups
    }
    base_ws = {
        g.name: torch.randn((g.in_dim, g.out_total), generator=gen, device=dev, dtype=torch.bfloat16) * 0.02
        for g in layout.groups
    }
    results = {}
    for design in ("serial", "side", "fused"):
        backend = TritonLoraBackend(pool, max_tokens=2048, max_seqs=64, design=design)
        backend.prepare(indptr, seg_slots, pad_to=pad_to, tile_class="auto")
        outs = {
            k: torch.empty((pad_to, layout.group(k[1]).out_total), device=dev, dtype=torch.bfloat16)
            for k in xs
        }
        _step(backend, xs, base_ws, outs, layout)  # compiles; eager result
        if graphed:
            graph = torch.cuda.CUDAGraph()
            with recording(graph):
                _step(backend, xs, base_ws, outs, layout)
            for _ in range(3):
                for o in outs.values():
                    o.fill_(float("nan"))  # each replay writes every output anew
                graph.replay()
        torch.cuda.synchronize()
        assert not backend._sync.any(), design
        results[design] = {k: o.clone() for k, o in outs.items()}
    ref = make_backend("torch", pool, max_tokens=2048)
    ref.prepare(indptr, seg_slots)
    T = indptr[-1]
    for (layer, name), serial in results["serial"].items():
        g = layout.group(name)
        base = xs[layer, name] @ base_ws[name]
        want = base.clone()
        ref.apply(xs[layer, name][:T], want[:T], layer, g)
        side = results["side"][layer, name]  # the same kernels (a race would be far off, or NaN)
        assert torch.isfinite(side).all() and rel_err(side - base, serial - base) < TOL[torch.bfloat16] / 4
        fused = results["fused"][layer, name]
        assert torch.isfinite(fused).all()
        assert torch.equal(fused[T:], base[T:]) and torch.equal(serial[T:], base[T:])  # padding rows
        assert rel_err((fused - base)[:T], (want - base)[:T]) < 2 * TOL[torch.bfloat16], (layer, name)
        assert rel_err((serial - base)[:T], (want - base)[:T]) < 2 * TOL[torch.bfloat16], (layer, name)
