"""A decode step's LoRA kernels (16 layers x 4 groups, shrink + expand, one CUDA graph, median µs) as a
decode graph replays them: 256 decodes padded to the 256 bucket, the tile class "auto" picks. Run from
the tree given as the first argument, to compare trees (a measurement script, not runtime code).
    python docs/results/session14_h100_2026-11-26/call9/decode_grid.py TREE"""

from __future__ import annotations

import sys

import torch
import triton

sys.path.insert(0, sys.argv[1])

from stages.worker.lora.triton_backend import TritonLoraBackend  # noqa: E402
from tools.bench_lora_step import layout_for, make_pool, make_step  # noqa: E402


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3


def measure(n_ad: int, ranks: list[int]) -> None:
    dev = torch.device("cuda")
    layout = layout_for("1b", max(ranks))
    pool, _ = make_pool(layout, 4 << 30, n_ad, ranks, dev, 0)
    indptr, slots = make_step(n_ad, 256, [], 0)
    backend = TritonLoraBackend(pool, max_tokens=8192, max_seqs=256)
    backend.prepare(indptr, slots, pad_to=256, tile_class="auto")
    xs = {g.name: torch.randn((256, g.in_dim), device=dev, dtype=torch.bfloat16) for g in layout.groups}
    outs = {g.name: torch.randn((256, g.out_total), device=dev, dtype=torch.bfloat16) for g in layout.groups}

    def step():
        for layer in range(layout.num_layers):
            for g in layout.groups:
                backend.apply(xs[g.name], outs[g.name], layer, g)

    info = backend.batch_info
    print(
        f"256 decodes, {n_ad} adapters of ranks {sorted(set(ranks))}: class {backend.tile_class}, "
        f"grid {info.num_tiles} tiles: {graph_us(step):8.1f} us"
    )


if __name__ == "__main__":
    measure(8, [16])
    measure(32, [16])
    measure(80, [8, 16, 32, 64])
