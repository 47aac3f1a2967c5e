"""The shrink's config on many-adapter decode steps (a measurement script, not runtime code): for each
case of call 1 and each group, one CUDA graph of that group's 16 shrinks (one a layer) as a decode graph
replays them (tile class "auto", class grids), with the heuristic's config and with split-K, K block,
warps and stages replaced; median µs. The expand is not run: the partials' layout follows the split.
    python docs/results/session15_h100_2026-11-26/call2/shrink_sweep.py"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kernels.lora_shrink import ShrinkConfig, lora_shrink  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "call1"))
from decode_many import CASES, graph_us, setup  # noqa: E402


def time_shrinks(layout, pool, info, views, xs, ws, bucket, g, cfg) -> float:
    v = ws[: cfg.split_k * bucket * g.num_slices * info.block_rank].view(
        cfg.split_k, bucket, g.num_slices, info.block_rank
    )

    def f():
        for layer in range(layout.num_layers):
            a, _, ranks, _ = views[layer, g.name]
            lora_shrink(xs[g.name], a, ranks, pool.rows, info, out=v, config=cfg, check=False)

    return graph_us(f)


def main() -> None:
    for name, n_ad, decodes, ranks in CASES:
        layout, pool, rk, slots, bucket, backend, xs, outs = setup(n_ad, decodes, ranks)
        info, configs, views = backend.batch_info, backend._configs, backend._views
        print(f"== {name}: class {backend.tile_class}, grid {info.num_tiles}, block_rank {info.block_rank}")
        ws = torch.empty(16 * bucket * 3 * info.block_rank, dtype=torch.float32, device="cuda")
        for g in layout.groups:
            base = configs[g.name][0]
            args = (layout, pool, info, views, xs, ws, bucket, g)
            res = [(time_shrinks(*args, base), base, "heuristic")]
            for split, bk, w, st in itertools.product((1, 2, 4, 8), (128, 256), (4, 8), (3,)):
                if g.in_dim // split < bk:
                    continue
                cfg = ShrinkConfig(
                    block_n=base.block_n, block_k=bk, split_k=split, num_warps=w, num_stages=st
                )
                if cfg != base:
                    res.append((time_shrinks(*args, cfg), cfg, ""))
            res.sort(key=lambda r: r[0])
            h = res[[r[2] for r in res].index("heuristic")][0]
            print(f"  {g.name}: heuristic {h:.1f} us ({base})")
            for us, cfg, tag in res[:6]:
                print(
                    f"    {us:7.1f} us ({us / h:5.3f})  split {cfg.split_k} bk {cfg.block_k} "
                    f"w {cfg.num_warps} st {cfg.num_stages} bn {cfg.block_n} {tag}"
                )
        del backend, pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
