"""A step's LoRA kernels (16 layers x 4 groups, shrink + expand, one CUDA graph, median µs), run from the
tree given as the first argument, to compare trees (a measurement script, not runtime code). Decode steps
take their tile class ("auto") as decode graphs do; mixed and prefill steps the bound, as step graphs do.
Calls 3-5 timed the first set of steps, call 6 the second, calls 7 and 8 both. Call 4's B2 runs also set
the shrink's split target (`kernels.lora_shrink.PROGRAMS_PER_SM`, an integer in that call's working copy
only; fd2eb4a has no such name).
    python docs/results/session15_h100_2026-11-26/steps_ab.py TREE [first|more|all] [PROGRAMS_PER_SM]"""

from __future__ import annotations

import sys

import torch
import triton

sys.path.insert(0, sys.argv[1])

from stages.worker.lora.triton_backend import TritonLoraBackend  # noqa: E402
from stages.worker.step_inputs import token_buckets  # noqa: E402
from tools.bench_lora_step import layout_for, make_pool, make_step  # noqa: E402

FIRST = (
    ("S1-like decode: 155 rank-16 adapters, 186 decodes", 155, [16], 186, [], "auto"),
    ("S2-like decode: 62 adapters of ranks 8-64, 256 decodes", 62, [8, 16, 32, 64], 256, [], "auto"),
    ("80 adapters of ranks 8-64, 256 decodes", 80, [8, 16, 32, 64], 256, [], "auto"),
    ("8 rank-16 adapters, 256 decodes", 8, [16], 256, [], "auto"),
    ("32 rank-16 adapters, 256 decodes", 32, [16], 256, [], "auto"),
    (
        "S2-like mixed: 80 adapters, 190 decodes + 512 + 256 prefill",
        80,
        [8, 16, 32, 64],
        190,
        [512, 256],
        None,
    ),
    ("32 rank-16 adapters, 64 decodes + 31 x 256 prefill", 32, [16], 64, [256] * 31, None),
)
MORE = (
    ("16 rank-64 adapters, 256 decodes", 16, [64], 256, [], "auto"),
    ("1 rank-16 adapter, 256 decodes", 1, [16], 256, [], "auto"),
    ("16 adapters of ranks 8-64, 64 decodes", 16, [8, 16, 32, 64], 64, [], "auto"),
    ("4 rank-16 adapters, 16 decodes", 4, [16], 16, [], "auto"),
    ("128 rank-16 adapters, 256 decodes", 128, [16], 256, [], "auto"),
    ("40 adapters of ranks 8-64, 128 decodes", 40, [8, 16, 32, 64], 128, [], "auto"),
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
    xs = {g.name: torch.randn((bucket, g.in_dim), device=dev, dtype=torch.bfloat16) for g in layout.groups}
    outs = {
        g.name: torch.randn((bucket, g.out_total), device=dev, dtype=torch.bfloat16) for g in layout.groups
    }

    def step():
        for layer in range(layout.num_layers):
            for g in layout.groups:
                backend.apply(xs[g.name], outs[g.name], layer, g)

    splits = "/".join(str(c[0].split_k) for c in backend._configs.values())
    print(
        f"{label:62s} class {backend.tile_class:4d} splits {splits:8s} {graph_us(step):8.1f} us", flush=True
    )


if __name__ == "__main__":
    which = sys.argv[2] if len(sys.argv) > 2 else "first"
    if len(sys.argv) > 3:
        import kernels.lora_shrink

        kernels.lora_shrink.PROGRAMS_PER_SM = int(sys.argv[3])
    for s in {"first": FIRST, "more": MORE, "all": FIRST + MORE}[which]:
        measure(*s)
