"""A step's LoRA kernels from the tree given as the first argument, one CUDA graph each (median µs), in two
chains: the LoRA kernels alone (as session 15's steps_ab.py) and each group's base GEMM (cuBLAS, F.linear)
before its shrink and expand, as the model runs them. To compare trees (a measurement script, not runtime
code).
    python docs/results/session18_h100_2026-11-26/call7/chain_ab.py TREE"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, sys.argv[1])

from stages.worker.lora.triton_backend import TritonLoraBackend  # noqa: E402
from stages.worker.step_inputs import token_buckets  # noqa: E402
from tools.bench_lora_step import layout_for, make_pool, make_step  # noqa: E402

STEPS = (
    ("S1-like decode: 155 rank-16 adapters, 186 decodes", 155, [16], 186, [], "auto"),
    ("S2-like decode: 62 adapters of ranks 8-64, 256 decodes", 62, [8, 16, 32, 64], 256, [], "auto"),
    ("S2-like mixed: 80 adapters, 190 decodes + 512 + 256", 80, [8, 16, 32, 64], 190, [512, 256], None),
    ("32 rank-16 adapters, 64 decodes + 31 x 256 prefill", 32, [16], 64, [256] * 31, None),
    ("16 rank-64 adapters, 256 decodes", 16, [64], 256, [], "auto"),
    ("40 adapters of ranks 8-64, 128 decodes", 40, [8, 16, 32, 64], 128, [], "auto"),
    ("128 rank-16 adapters, 256 decodes", 128, [16], 256, [], "auto"),
    ("8 rank-16 adapters, 256 decodes", 8, [16], 256, [], "auto"),
    ("1 rank-16 adapter, 256 decodes", 1, [16], 256, [], "auto"),
    ("4 rank-16 adapters, 16 decodes", 4, [16], 16, [], "auto"),
)


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3


def measure(label, n_ad, ranks, decodes, prefill, tile_class) -> None:
    dev = torch.device("cuda")
    layout = layout_for("1b", max(ranks))
    pool, _ = make_pool(layout, 4 << 30, n_ad, ranks, dev, 0)
    indptr, slots = make_step(n_ad, decodes, prefill, 0)
    bucket = next(b for b in token_buckets(8192) if b >= indptr[-1])
    backend = TritonLoraBackend(pool, max_tokens=8192, max_seqs=256)
    backend.prepare(indptr, slots, pad_to=bucket, tile_class=tile_class)
    bf = torch.bfloat16
    xs = {g.name: torch.randn((bucket, g.in_dim), device=dev, dtype=bf) for g in layout.groups}
    ws = {g.name: torch.randn((g.out_total, g.in_dim), device=dev, dtype=bf) * 0.02 for g in layout.groups}
    outs = {g.name: torch.randn((bucket, g.out_total), device=dev, dtype=bf) for g in layout.groups}

    def lora_only():
        for layer in range(layout.num_layers):
            for g in layout.groups:
                backend.apply(xs[g.name], outs[g.name], layer, g)

    def with_gemm():
        for layer in range(layout.num_layers):
            for g in layout.groups:
                backend.apply(xs[g.name], F.linear(xs[g.name], ws[g.name]), layer, g)

    lora, gemm = graph_us(lora_only), graph_us(with_gemm)
    print(f"{label[:58]:58s} lora {lora:8.1f} us  gemm {gemm:8.1f} us", flush=True)


if __name__ == "__main__":
    for s in STEPS:
        measure(*s)
