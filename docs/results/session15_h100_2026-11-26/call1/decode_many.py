"""Where a decode step's LoRA time goes when it has many adapters (a measurement script, not runtime
code). For S1-like (155 rank-16 adapters over 186 decodes), S2-like (62 adapters of ranks 8-64 over 256
decodes) and the 8-adapter baseline: one CUDA graph of the step's 128 LoRA launches as a decode graph
replays them (tile class "auto"), graphs of its shrinks alone and expands alone, the bytes floor at the
measured copy bandwidth, and each kernel's device time inside the graph (torch profiler, mean over the
16 layers).
    python docs/results/session15_h100_2026-11-26/call1/decode_many.py [--ncu-layer]"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kernels.lora_expand import lora_expand  # noqa: E402
from kernels.lora_shrink import lora_shrink  # noqa: E402
from stages.worker.lora.triton_backend import TritonLoraBackend  # noqa: E402
from stages.worker.step_inputs import token_buckets  # noqa: E402
from tools.bench_lora_step import floor_bytes, layout_for, make_pool, make_step  # noqa: E402

CASES = (("S1-like", 155, 186, [16]), ("S2-like", 62, 256, [8, 16, 32, 64]), ("8 adapters", 8, 256, [16]))


def graph(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_us(fn) -> float:
    g = graph(fn)
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3


def copy_tbps() -> float:
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e12


def setup(n_ad, decodes, ranks):
    dev = torch.device("cuda")
    layout = layout_for("1b", max(ranks))
    pool, rk = make_pool(layout, 4 << 30, n_ad, ranks, dev, 0)
    indptr, slots = make_step(n_ad, decodes, [], 0)
    bucket = next(b for b in token_buckets(8192) if b >= decodes)
    backend = TritonLoraBackend(pool, max_tokens=8192, max_seqs=256)
    backend.prepare(indptr, slots, pad_to=bucket, tile_class="auto")
    xs = {g.name: torch.randn((bucket, g.in_dim), device=dev, dtype=torch.bfloat16) for g in layout.groups}
    outs = {
        g.name: torch.randn((bucket, g.out_total), device=dev, dtype=torch.bfloat16) for g in layout.groups
    }
    return layout, pool, rk, slots, bucket, backend, xs, outs


def launchers(layout, pool, backend, xs, outs, layers=None):
    info, configs, views = backend.batch_info, backend._configs, backend._views
    layers = range(layout.num_layers) if layers is None else layers

    def shrink(layer, g):
        sc, _, v = configs[g.name]
        a, _, ranks, _ = views[layer, g.name]
        lora_shrink(xs[g.name], a, ranks, pool.rows, info, out=v, config=sc, check=False)

    def expand(layer, g):
        _, ec, v = configs[g.name]
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

    def shrinks():
        for layer in layers:
            for g in layout.groups:
                shrink(layer, g)

    def expands():
        for layer in layers:
            for g in layout.groups:
                expand(layer, g)

    def both():
        for layer in layers:
            for g in layout.groups:
                shrink(layer, g)
                expand(layer, g)

    return shrinks, expands, both


def per_kernel(layout, both) -> dict:
    """Device µs of each (group, kernel) inside one replay of the step's graph, mean over layers."""
    g = graph(both)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    names = [
        f"{gr.name}:{k}"
        for _ in range(layout.num_layers)
        for gr in layout.groups
        for k in ("shrink", "expand")
    ]
    out = defaultdict(list)
    per = len(names)
    if len(events) % per:
        print(f"   ({len(events)} kernel events, not a multiple of {per})")
        return {}
    for i, e in enumerate(events):
        out[names[i % per]].append(e.time_range.elapsed_us())
    return {k: sum(v) / len(v) for k, v in out.items()}


def main() -> None:
    tbps = copy_tbps()
    print(f"copy bandwidth {tbps:.2f} TB/s")
    for name, n_ad, decodes, ranks in CASES:
        layout, pool, rk, slots, bucket, backend, xs, outs = setup(n_ad, decodes, ranks)
        info = backend.batch_info
        shrinks, expands, both = launchers(layout, pool, backend, xs, outs)
        floor = floor_bytes(layout, decodes, [rk[s] for s in sorted(set(slots))])
        floor_us = floor / (tbps * 1e12) * 1e6
        t_both, t_s, t_e = graph_us(both), graph_us(shrinks), graph_us(expands)
        print(
            f"== {name}: {n_ad} adapters of ranks {ranks}, {decodes} decodes -> bucket {bucket}, class "
            f"{backend.tile_class}, grid {info.num_tiles} tiles, block_rank {info.block_rank}"
        )
        cfg = {k: (c[0], c[1]) for k, c in backend._configs.items()}
        print(f"   configs {cfg}")
        print(f"   floor {floor / 1e9:.3f} GB = {floor_us:.1f} us")
        print(
            f"   both {t_both:.1f} us ({100 * floor_us / t_both:.1f} % of floor); shrinks {t_s:.1f}, "
            f"expands {t_e:.1f}"
        )
        for k, us in per_kernel(layout, both).items():
            print(f"   {k:16s} {us:7.2f} us")
        if "--ncu-layer" in sys.argv and name == "S1-like":
            _, _, one = launchers(layout, pool, backend, xs, outs, layers=[0])
            one()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            one()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        del backend, pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
