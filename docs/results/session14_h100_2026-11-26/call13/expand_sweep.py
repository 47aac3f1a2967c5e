"""The expand's column block and warps on decode steps as decode graphs now replay them (tile class
"auto", grids of 1.5 c tiles): one CUDA graph of the step's 128 LoRA launches (median µs), the expand's
config replaced in every group (a measurement script, not runtime code).
    python docs/results/session14_h100_2026-11-26/call13/expand_sweep.py"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kernels.lora_expand import ExpandConfig  # noqa: E402
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
    info = backend.batch_info
    base = backend.configs_for(dataclasses.replace(info, num_tiles=backend.tile_class))
    xs = {g.name: torch.randn((256, g.in_dim), device=dev, dtype=torch.bfloat16) for g in layout.groups}
    outs = {g.name: torch.randn((256, g.out_total), device=dev, dtype=torch.bfloat16) for g in layout.groups}

    def run(configs):
        def step():
            for layer in range(layout.num_layers):
                for g in layout.groups:
                    backend.apply_as(info, configs, xs[g.name], outs[g.name], layer, g)

        return graph_us(step)

    heur = {name: ec for name, (_, ec, _) in base.items()}
    print(f"== 256 decodes, {n_ad} adapters of ranks {sorted(set(ranks))}: class {backend.tile_class}, grid")
    print(f"   {info.num_tiles} tiles; the heuristic's expand configs {heur}")
    print(f"   heuristic: {run(base):8.1f} us")
    for bn in (128, 256, 512, 1024):
        for w in (4, 8):
            for bk in sorted({min(info.block_rank, 64), 16}):
                cfg = {
                    name: (sc, ExpandConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=2), v)
                    for name, (sc, _, v) in base.items()
                }
                print(f"   block_n {bn:4d}, block_k {bk:2d}, {w} warps: {run(cfg):8.1f} us")


if __name__ == "__main__":
    measure(8, [16])
    measure(32, [16])
    measure(80, [8, 16, 32, 64])
