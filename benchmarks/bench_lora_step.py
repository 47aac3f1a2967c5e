"""Device time of one step's LoRA kernels (shrink and expand of every group and layer) on a multi-tenant
step, launched as the worker launches them: the Triton backend over a rank-paged pool holding adapters
of mixed ranks at scattered rows, tokens ordered by adapter id, the step padded to its graph bucket.
Each variant is one CUDA graph of the whole step's launches, replayed with L2 flushed (median); the
memory floor is the bytes that must move (activations in and out once, each distinct adapter's rows
once) at the measured copy bandwidth.
    python -m benchmarks.bench_lora_step [--preset 1b] [--pool-gb 4] [--adapters 80] [--decodes 190]
        [--prefill 512,256] [--max-seqs 256] [--ranks 8,16,32,64] [--sweep] [--only TEXT] [--out FILE]
        [--act none|unfused|fused|both] [--lora-dtype auto|fp8|int8] [--design serial|fused] [--smoke]
With --act the gate_up group's activation is part of the step: its expand and then `silu_mul`
(unfused), or the two as one kernel (fused, `kernels/lora_expand_act.py`); the graphed check is then the
layer-0 activation's, against float64. With --lora-dtype fp8 or int8 the pool's rows are 8-bit with their
scales (`kernels/lora_quant.py`), the floor counts one byte an element and the check dequantizes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from kernels.batch_info import plan_runs, plan_tiles  # noqa: E402
from kernels.lora_expand import ExpandConfig  # noqa: E402
from kernels.lora_quant import QUANT_DTYPES, a_scales, b_scales  # noqa: E402
from kernels.lora_shrink import ShrinkConfig  # noqa: E402
from kernels.silu_mul import silu_mul  # noqa: E402
from runtime.common.lora_layout import LoraLayout  # noqa: E402
from runtime.common.model_config import ModelConfig  # noqa: E402
from runtime.synthetic.model import PRESETS, build_config  # noqa: E402
from stages.worker.graph_capture import recording  # noqa: E402
from stages.worker.lora.backend import PADDED_BLOCK_M  # noqa: E402
from stages.worker.lora.pool import LoraPool, pool_geometry  # noqa: E402
from stages.worker.lora.triton_backend import (  # noqa: E402
    DESIGNS,
    TritonLoraBackend,
    padded_tile_bound,
    workspace_rows,
)
from stages.worker.step_inputs import token_buckets  # noqa: E402


def layout_for(preset: str, max_rank: int) -> LoraLayout:
    """The LoRA layout of a make_tiny_model preset's Llama shapes."""
    return LoraLayout.for_model(ModelConfig.from_dict(build_config("llama", preset)), max_rank)


def make_pool(
    layout: LoraLayout,
    nbytes: int,
    n_ad: int,
    rank_cycle: list[int],
    device,
    seed: int,
    lora_dtype: str = "auto",
) -> tuple[LoraPool, list[int]]:
    """A pool of `nbytes` whose ids 0..n_ad-1 hold adapters of ranks cycling over `rank_cycle`, every
    rank row at a random free pool row (as after churn), random weights (8-bit: random codes and
    scales of the same magnitude)."""
    rows, ids = pool_geometry(layout, torch.bfloat16, nbytes, lora_dtype)
    pool = LoraPool(layout, rows, ids, torch.bfloat16, device, lora_dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    for layer in range(layout.num_layers):
        if pool.scales is None:
            pool.mem[layer].normal_(0.0, 0.02)
            continue
        codes = torch.empty(pool.mem[layer].shape, device=device).normal_(0.0, 40.0).clamp_(-127, 127)
        pool.mem[layer].copy_(codes.round() if pool.mem.dtype == torch.int8 else codes)
        pool.scales[layer].uniform_(0.0004, 0.0006)
    ranks = [rank_cycle[i % len(rank_cycle)] for i in range(n_ad)]
    if sum(ranks) > rows:
        raise SystemExit(f"{n_ad} adapters need {sum(ranks)} rank rows; the pool has {rows}")
    perm = torch.randperm(rows, generator=g)
    k = 0
    for i, r in enumerate(ranks):
        pool.host_rows[i, :r] = perm[k : k + r].to(torch.int32)
        pool.host_ranks[i] = r
        pool.host_scalings[i] = 2.0
        k += r
    pool.rows.copy_(pool.host_rows)
    pool.ranks.copy_(pool.host_ranks)
    pool.scalings.copy_(pool.host_scalings)
    return pool, ranks


def make_step(n_ad: int, decodes: int, prefill: list[int], seed: int) -> tuple[list[int], list[int]]:
    """(seg_indptr, seg_slots) of a step ordered by adapter id: `decodes` one-token sequences over the
    n_ad adapters (each at least once, the rest Zipf), and prefill chunks of the given lengths."""
    rng = np.random.default_rng(seed)
    if decodes < n_ad:
        raise SystemExit(f"--decodes {decodes} must be at least --adapters {n_ad} (each adapter once)")
    w = 1.0 / np.arange(1, n_ad + 1)
    extra = rng.choice(n_ad, size=decodes - n_ad, p=w / w.sum())
    seqs = [(a, 1) for a in range(n_ad)] + [(int(a), 1) for a in extra]
    seqs += [(int(rng.integers(n_ad)), n) for n in prefill]
    seqs.sort(key=lambda s: s[0])
    indptr, slots = [0], []
    for a, n in seqs:
        indptr.append(indptr[-1] + n)
        slots.append(a)
    return indptr, slots


def floor_bytes(layout: LoraLayout, tokens: int, ranks: list[int], row_elt: int = 2) -> int:
    """Bytes a step's LoRA must move: per layer and group x read, out read and written, v written and
    read (fp32, as wide as the largest rank), every distinct adapter's A and B rows once (real ranks;
    `row_elt` bytes an element, 1 for 8-bit rows, whose scales add 4 bytes a slice's row)."""
    total = 0
    rsum = sum(ranks)
    for g in layout.groups:
        n = g.num_slices
        total += 2 * tokens * g.in_dim + 4 * tokens * g.out_total
        total += rsum * (row_elt * (n * g.in_dim + g.out_total) + (8 * n if row_elt == 1 else 0))
        total += 2 * 4 * tokens * n * max(ranks)
    return total * layout.num_layers


def with_configs(backend, info, g, sc, ec, v, shrink, expand):
    """A group's (shrink, expand, shrink output view) with one kernel's config replaced (the output view
    follows the shrink's partials; the rank tile bounds the shrink's column block and the expand's rank
    step). A replacement keeps the heuristic's choice of dependent launch, so that a sweep compares
    block shapes alone."""
    if shrink is not None:
        if shrink.block_n > info.block_rank and shrink.block_n % info.block_rank:
            shrink = dataclasses.replace(shrink, block_n=info.block_rank)
        sc = dataclasses.replace(shrink, pdl=sc.pdl)
        v = backend.shrink_output(info, g, sc)
    if expand is not None:
        ec = dataclasses.replace(expand, block_k=min(expand.block_k, info.block_rank), pdl=ec.pdl)
    return sc, ec, v


def shrink_as_for(make, tiles: int, backend: TritonLoraBackend):
    """`make` with every group's kernel configs (and partials view) chosen as if the step had `tiles`
    tiles (the shrink's split-K and column block depend on it); the grids still cover the variant's own
    tile count."""

    def made():
        info, configs = make()
        if tiles:  # the expand's rank step follows the shrink's split-K
            configs = backend.configs_for(dataclasses.replace(info, num_tiles=tiles))
        return info, configs

    return made


def step_graph_us(backend: TritonLoraBackend, info, configs, xs, outs, layout, device, ref=None, act=False):
    """Median µs of one replay of every layer's and group's shrink + expand, as one CUDA graph, and the
    relative error of one more replay's layer-0 gate_up delta against `ref` (from `check`), if given.
    `act`: the gate_up group's activation too (fused or not as the backend's `fuse_act` says); the error
    is then that of layer 0's activation of a zero projection plus the delta."""

    def launches():
        first = None
        for layer in range(layout.num_layers):
            for g in layout.groups:
                x, out = xs[layer][g.name], outs[layer][g.name]
                if act and g.name == "gate_up":
                    y = backend.apply_act_as(info, configs, x, out, layer, g, silu_mul)
                    first = y if first is None else first
                else:
                    backend.apply_as(info, configs, x, out, layer, g)
        return first

    launches()
    if device.type != "cuda":
        t0 = time.perf_counter()
        launches()
        return (time.perf_counter() - t0) * 1e6, None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with recording(graph):
        first = launches()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    err = None
    if ref is not None:
        out = outs[0][layout.group("gate_up").name]
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got, want = out.double(), ref
        if act:
            got, want = first.double(), act_ref(ref)
        err = float((got - want).norm() / want.norm())
    del graph
    return ms * 1e3, err


def act_ref(delta: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a zero projection plus `delta` [T, 2I], float64."""
    gate, up = delta.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def check(backend, info, configs, xs, outs, layout, pool, indptr, slots) -> tuple[float, torch.Tensor]:
    """Relative error of layer 0's gate_up against a float64 torch reference (gathered pool rows), and
    that reference delta."""
    g = layout.group("gate_up")
    x, out = xs[0][g.name], outs[0][g.name]
    out.zero_()  # the delta alone: bf16 rounding of a large `out` would hide it
    before = out.double()
    backend.apply_as(info, configs, x, out, 0, g)
    base = pool.mem[0]
    a, b = LoraLayout.a_rows(base, g), LoraLayout.b_rows(base, g)
    scales = pool.scales[0] if pool.scales is not None else None
    delta = torch.zeros_like(before)
    for i, slot in enumerate(slots):
        lo, hi = indptr[i], indptr[i + 1]
        r = int(pool.host_ranks[slot, 0, g.first_slice])
        rows = pool.host_rows[slot, :r].long().to(x.device)
        for s, (off, w) in enumerate(zip(g.out_offsets, g.out_dims, strict=True)):
            a_s, b_s = a[rows, s].double(), b[rows, off : off + w].double()
            if scales is not None:  # 8-bit rows times their scales
                a_s = a_s * a_scales(scales, g.first_slice, g.num_slices)[rows, s, None].double()
                b_s = b_s * b_scales(scales, g.first_slice, g.num_slices)[rows, s, None].double()
            v = x[lo:hi].double() @ a_s.t()
            delta[lo:hi, off : off + w] = 2.0 * v @ b_s
    return float((out.double() - before - delta).norm() / delta.norm()), delta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--pool-gb", type=float, default=4.0)
    p.add_argument("--adapters", type=int, default=80, help="distinct adapters in the step")
    p.add_argument("--decodes", type=int, default=190, help="one-token sequences")
    p.add_argument(
        "--prefill", default="512,256", help="prefill chunk lengths, comma-separated ('' for none)"
    )
    p.add_argument(
        "--max-seqs", type=int, default=256, help="sequences a step can hold (max running requests)"
    )
    p.add_argument("--ranks", default="8,16,32,64", help="adapter ranks, cycled over the adapter ids")
    p.add_argument("--sweep", action="store_true", help="also time kernel configs on the 16-token tile")
    p.add_argument("--only", default=None, metavar="TEXT", help="time only the variants whose name has TEXT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--config-tiles",
        default=None,
        metavar="N,N,...",
        help="also time each chosen variant with its kernel configs chosen as for N tiles (0: its own count)",
    )
    p.add_argument(
        "--act",
        choices=("none", "unfused", "fused", "both"),
        default="none",
        help="include the gate_up activation: after the expand, fused into it, or each variant both ways",
    )
    p.add_argument("--lora-dtype", choices=("auto", *QUANT_DTYPES), default="auto", help="the pool's rows")
    p.add_argument(
        "--design",
        choices=DESIGNS,
        default=None,
        help="the backend's design (default: $LORAPIPE_LORA_DESIGN or serial); "
        "'side' runs as 'serial' here (no base GEMM to run beside)",
    )
    p.add_argument("--out")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes and pool, to check the script on the CPU"
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.preset, a.pool_gb = "tiny", 0.002
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cycle = [int(r) for r in a.ranks.split(",")]
    layout = layout_for(a.preset, max(cycle))
    layers = layout.num_layers
    pool, ranks = make_pool(layout, int(a.pool_gb * 2**30), a.adapters, cycle, device, a.seed, a.lora_dtype)
    prefill = [int(n) for n in a.prefill.split(",") if n]
    indptr, slots = make_step(a.adapters, a.decodes, prefill, a.seed)
    tokens = indptr[-1]
    bucket = next(b for b in token_buckets(8192) if b >= tokens)
    backend = TritonLoraBackend(pool, max_tokens=8192, design=a.design)
    torch.manual_seed(a.seed)
    xs = [
        {g.name: torch.randn((bucket, g.in_dim), device=device, dtype=torch.bfloat16) for g in layout.groups}
        for _ in range(layers)
    ]
    outs = [
        {
            g.name: torch.randn((bucket, g.out_total), device=device, dtype=torch.bfloat16)
            for g in layout.groups
        }
        for _ in range(layers)
    ]

    copy_tbps = None
    if device.type == "cuda":
        src = torch.empty(1 << 29, dtype=torch.int16, device=device)
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
        copy_tbps = 2 * src.numel() * 2 / (ms * 1e-3) / 1e12
        del src, dst
    row_elt = 1 if pool.scales is not None else 2
    floor = floor_bytes(layout, tokens, [ranks[s] for s in sorted(set(slots))], row_elt)
    floor_us = floor / ((copy_tbps or 3.0) * 1e12) * 1e6

    # Variants: the backend's eager preparation (grids of the real tiles), and the graphed one at each
    # token tile: the backend here has no max_seqs, so its bound counts every pool id (as before
    # bc5b3a4); rows with the runner's bound (--max-seqs) and with the step's own tile count follow.
    # Every preparation rewrites the backend's one device metadata buffer, so each variant is prepared
    # again right before it runs.
    def prepared(pad_to=None, block_m=None, num_tiles=None, shrink=None, expand=None):
        def make():
            backend.prepare(indptr, slots, pad_to=pad_to, block_m=block_m)
            info = backend.batch_info
            if num_tiles is not None:
                info = dataclasses.replace(info, num_tiles=num_tiles)
            configs = backend.configs_for(info)
            if shrink or expand:
                configs = {
                    k: with_configs(backend, info, layout.group(k), sc, ec, v, shrink, expand)
                    for k, (sc, ec, v) in configs.items()
                }
            return info, configs

        return make

    variants = {"eager (real tiles)": prepared()}
    real_tiles = prepared()()[0].num_tiles
    for bm in sorted({PADDED_BLOCK_M, 32, 64}):
        own = plan_tiles(plan_runs(indptr, slots), bm).shape[0]  # the tiles this step has at this tile
        bound = padded_tile_bound(bucket, bm, pool.num_ids, None)
        variants[f"graphed bm{bm} (bound {bound})"] = prepared(bucket, bm)
        tight = padded_tile_bound(bucket, bm, pool.num_ids, a.max_seqs)
        for label, nt in ((f"bound {tight}", tight), (f"bound = its {own} tiles", own)):
            if nt < bound:
                variants[f"graphed bm{bm} ({label})"] = prepared(bucket, bm, nt)
    if a.sweep:
        tight = padded_tile_bound(bucket, 16, pool.num_ids, a.max_seqs)
        for bn in (64, 128, 256):
            for bk in (16, 64):
                for w in (2, 4, 8):
                    ec = ExpandConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=2)
                    variants[f"bm16 bound {tight}, expand {bn}/{bk}/{w}w"] = prepared(
                        bucket, 16, tight, expand=ec
                    )
        for bn in (16, 32, 64, 128):
            for split in (1, 2, 4):
                for w in (4, 8):
                    if split * bucket > workspace_rows(8192):
                        continue  # the partials would not fit the backend's workspace
                    sc = ShrinkConfig(block_n=bn, block_k=128, split_k=split, num_warps=w, num_stages=3)
                    variants[f"bm16 bound {tight}, shrink {bn}/s{split}/{w}w"] = prepared(
                        bucket, 16, tight, shrink=sc
                    )
    if a.only is not None:
        variants = {k: v for k, v in variants.items() if a.only in k}
        if not variants:
            raise SystemExit(f"--only {a.only!r} matches no variant")
    if a.config_tiles is not None:
        variants = {
            f"{name}, configs as for {int(n) or 'its'} tiles": shrink_as_for(make, int(n), backend)
            for name, make in variants.items()
            for n in a.config_tiles.split(",")
        }
    modes = {"none": [None], "unfused": [False], "fused": [True], "both": [False, True]}[a.act]
    runs = [
        (name if fuse is None else f"{name}, act {'fused' if fuse else 'unfused'}", make, fuse)
        for name, make in variants.items()
        for fuse in modes
    ]
    rows = []
    for name, make, fuse in runs:
        backend.fuse_act = bool(fuse)  # the configs follow it: made after
        info, configs = make()
        err, ref = check(backend, info, configs, xs, outs, layout, pool, indptr, slots)
        us, graph_err = step_graph_us(backend, info, configs, xs, outs, layout, device, ref, fuse is not None)
        rows.append(
            dict(
                variant=name,
                us=us,
                pct_floor=100 * floor_us / us,
                err=err,
                graph_err=graph_err,
                tiles=info.num_tiles,
                block_m=info.block_m,
                block_rank=info.block_rank,
            )
        )
        ge = "" if graph_err is None else f", graphed {graph_err:.1e}"
        print(
            f"{name:45s} {us:9.1f} us  {100 * floor_us / us:5.1f} % of floor  err {err:.1e}{ge}", flush=True
        )
    summary = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        copy_tbps=copy_tbps,
        design=backend.design,
        preset=a.preset,
        adapters=a.adapters,
        distinct=len(set(slots)),
        ranks={str(r): sum(ranks[s] == r for s in set(slots)) for r in sorted(set(cycle))},
        decodes=a.decodes,
        prefill=prefill,
        tokens=tokens,
        bucket=bucket,
        real_tiles=real_tiles,
        pool_ids=pool.num_ids,
        pool_rows=pool.total_rows,
        floor_bytes=floor,
        floor_us=floor_us,
        rows=rows,
    )
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
