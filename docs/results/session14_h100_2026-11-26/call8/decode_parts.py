"""Where a decode step's LoRA time goes (a measurement script, not runtime code): one CUDA graph of all
128 LoRA launches of a 1B step (16 layers x 4 groups x shrink + expand), against graphs of the shrinks
alone, the expands alone, and 128 launches of a kernel that reads the batch header and returns, on the
shrink's and the expand's grids (the floor of launching that many programs). 256 decodes over 8 or 32
rank-16 adapters, padded to the 256 bucket, configs of tile class 32 (what a decode graph replays).
    python docs/results/session14_h100_2026-11-26/call8/decode_parts.py"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kernels.lora_expand import lora_expand  # noqa: E402
from kernels.lora_shrink import lora_shrink  # noqa: E402
from stages.worker.lora.triton_backend import TritonLoraBackend  # noqa: E402
from tools.bench_lora_step import layout_for, make_pool, make_step  # noqa: E402


@triton.jit
def _header_only(meta_ptr):
    if tl.program_id(0) >= tl.load(meta_ptr):
        return
    tl.store(meta_ptr + 3, 0)  # never reached: the header says fewer tiles than programs


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3


def main() -> None:
    for n_ad in (8, 32):
        measure(n_ad)


def measure(n_ad: int) -> None:
    dev = torch.device("cuda")
    layout = layout_for("1b", 16)
    pool, _ = make_pool(layout, 4 << 30, n_ad, [16], dev, 0)
    indptr, slots = make_step(n_ad, 256, [], 0)
    backend = TritonLoraBackend(pool, max_tokens=8192, max_seqs=256)
    backend.prepare(indptr, slots, pad_to=256, tile_class=32)
    info, configs = backend.batch_info, backend._configs
    xs = {g.name: torch.randn((256, g.in_dim), device=dev, dtype=torch.bfloat16) for g in layout.groups}
    outs = {g.name: torch.randn((256, g.out_total), device=dev, dtype=torch.bfloat16) for g in layout.groups}
    views = backend._views

    def shrinks():
        for layer in range(layout.num_layers):
            for g in layout.groups:
                sc, _, v = configs[g.name]
                a, _, ranks, _ = views[layer, g.name]
                lora_shrink(xs[g.name], a, ranks, pool.rows, info, out=v, config=sc, check=False)

    def expands():
        for layer in range(layout.num_layers):
            for g in layout.groups:
                sc, ec, v = configs[g.name]
                _, b, ranks, scal = views[layer, g.name]
                lora_expand(
                    v,
                    b,
                    ranks,
                    scal,
                    pool.rows,
                    outs[g.name],
                    g.out_offsets,
                    g.out_dims,
                    info,
                    config=ec,
                    check=False,
                )

    def both():
        for layer in range(layout.num_layers):
            for g in layout.groups:
                backend.apply(xs[g.name], outs[g.name], layer, g)

    empty = torch.zeros((1, 4), dtype=torch.int32, device=dev)
    grids = {
        g.name: (
            (
                info.num_tiles
                * triton.cdiv(g.num_slices * info.block_rank, configs[g.name][0].block_n)
                * configs[g.name][0].split_k,
            ),
            (info.num_tiles * sum(triton.cdiv(w, configs[g.name][1].block_n) for w in g.out_dims),),
        )
        for g in layout.groups
    }

    def floor(which):
        def run():
            for _ in range(layout.num_layers):
                for g in layout.groups:
                    _header_only[grids[g.name][which]](empty)

        return run

    print(f"== 256 decodes over {n_ad} rank-16 adapters (tiles bound {info.num_tiles}, class 32)")
    programs = {k: (v[0][0], v[1][0]) for k, v in grids.items()}
    print(f"   programs per group (shrink, expand): {programs}")
    print(f"   shrink + expand, 128 launches:     {graph_us(both):8.1f} us")
    print(f"   shrinks alone, 64 launches:        {graph_us(shrinks):8.1f} us")
    print(f"   expands alone, 64 launches:        {graph_us(expands):8.1f} us")
    print(f"   header-only on the shrink grids:   {graph_us(floor(0)):8.1f} us")
    print(f"   header-only on the expand grids:   {graph_us(floor(1)):8.1f} us")

    def single():
        for _ in range(64):
            _header_only[(1,)](empty)

    print(f"   64 header-only launches of 1 program: {graph_us(single):8.1f} us")


if __name__ == "__main__":
    main()
