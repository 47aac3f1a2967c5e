"""Host→device leg of adapter loads: plain pinned→device copies of one large buffer (the ceiling) against
the worker's pool copy, `LoraPool.load(id, packed, runs, stream)` on a load stream, for adapters of several
sizes read with `read_adapter(..., pin_memory=True)` and, as the worker holds them, from the registered
shared-memory host pool. Medians of CUDA-event times on the load stream (host clock on the CPU, where the
numbers only exercise the tool). Reads the model's config.json only; adapters are generated.
Prints one table; `--out` writes JSON.
    python -m benchmarks.bench_h2d --model DIR [--sizes-mb 16,64,335] [--reps 30] [--out FILE]"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from proto.plan import SlotLoad
from runtime.common.host_pool import (
    block_tensor,
    create_pool,
    dtype_name,
    packed_from_pool,
    pool_bytes_for,
    register_pinned,
    unlink_pool,
    unregister_pinned,
)
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype
from runtime.common.packed import PackedAdapter
from runtime.synthetic.adapters import make_adapters
from stages.loader.adapter_reader import read_adapter
from stages.worker.lora.pool import LoraPool

SCHEMA_VERSION = 1
HOLD_CYCLES = 40_000_000  # ~20 ms of GPU sleep: every copy is queued before the stream reaches them


class Timer:
    """Seconds per call of `fn`: CUDA events on `stream` (its own work only), else the host clock."""

    def __init__(self, stream: torch.cuda.Stream | None, reps: int, warmup: int):
        self.stream, self.reps, self.warmup = stream, reps, warmup

    def times(self, fn: Callable[[], None], hold: bool = False) -> list[float]:
        """`hold`: the stream sleeps first, so the copies run back to back (DMA time, no launch gaps)."""
        for _ in range(self.warmup):
            fn()
        if self.stream is None:
            return self.issue(fn)  # the host clock
        torch.cuda.synchronize()
        out = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hold:
                self._hold()
            start.record(self.stream)
            fn()
            end.record(self.stream)
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out

    def issue(self, fn: Callable[[], None]) -> list[float]:
        """Host seconds `fn` takes to return while the stream is still busy with earlier work: a copy
        path that waits for the stream (a pageable copy, a sync) shows up here as milliseconds."""
        out = []
        for _ in range(self.reps):
            self._hold()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            if self.stream is not None:
                self.stream.synchronize()
        return out

    def _hold(self) -> None:
        """Keep the stream busy (a GPU sleep) so that what is queued next waits behind it."""
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(HOLD_CYCLES)


def gbps(nbytes: int, seconds: Sequence[float]) -> float:
    """GB/s (1e9 bytes) at the median time."""
    return nbytes / statistics.median(seconds) / 1e9


def rank_for(size_mb: float, per_rank: int) -> int:
    """The smallest rank whose packed adapter is at least `size_mb` MB (1e6 bytes)."""
    return max(1, math.ceil(size_mb * 1e6 / per_rank))


def make_packed(model: Path, work: Path, ranks: Sequence[int], dtype: torch.dtype, pin: bool, seed: int):
    """One generated adapter per rank (all linear layers), read and packed as the loader packs them."""
    cfg = ModelConfig.from_dir(model)
    layout = LoraLayout.for_model(cfg, max(ranks))
    out = []
    for r in ranks:
        (path,) = make_adapters(model, work / f"r{r}", n=1, ranks=(r,), dtype=dtype_name(dtype), seed=seed)
        out.append(read_adapter(f"r{r}", path, cfg, layout, dtype, pin_memory=pin))
    return layout, out


def slot_load_of(packed: PackedAdapter, pool_name: str, layout: LoraLayout) -> SlotLoad:
    """The SlotLoad the scheduler would send for `packed` staged at offset 0 of the pool."""
    return SlotLoad(
        slot=0,
        adapter=packed.name,
        shm_name=pool_name,
        offset=0,
        nbytes=packed.nbytes,
        rank=packed.rank,
        layer_nbytes=packed.rank * layout.row_elems * packed.block.element_size(),
        dtype=dtype_name(packed.block.dtype),
        slice_ranks=packed.ranks.flatten().tolist(),
        slice_scalings=packed.scalings.flatten().tolist(),
    )


def run(ns: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(ns.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (use --device cpu to try the tool)")
    dtype = parse_dtype(ns.dtype, torch.bfloat16)
    per_rank = LoraLayout.for_model(ModelConfig.from_dir(ns.model), 1).block_bytes(1, dtype)
    ranks = [rank_for(mb, per_rank) for mb in ns.sizes_mb]
    with tempfile.TemporaryDirectory(prefix="bench_h2d-", dir=ns.work_dir) as work:
        layout, adapters = make_packed(ns.model, Path(work), ranks, dtype, cuda, ns.seed)
    stream = torch.cuda.Stream(device) if cuda else None
    timer = Timer(stream, ns.reps, ns.warmup)
    slots = LoraPool(layout, layout.max_rank, 1, dtype, device)  # one adapter's rows: a contiguous run

    peak_bytes = max(int(ns.peak_mb * 1e6), *(a.nbytes for a in adapters))
    src = torch.empty(peak_bytes, dtype=torch.uint8, pin_memory=cuda).fill_(7)
    dst = torch.empty(peak_bytes, dtype=torch.uint8, device=device)

    def copy(n: int) -> Callable[[], None]:
        def fn() -> None:
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                dst[:n].copy_(src[:n], non_blocking=cuda)

        return fn

    peak_t = timer.times(copy(peak_bytes))
    peak = gbps(peak_bytes, peak_t)
    rows = [measure(a, slots, timer, copy, cuda, peak, ns) for a in adapters]
    if not ns.no_pool:
        measure_pool(adapters, rows, layout, slots, timer, cuda, peak, dtype)
    for row in rows:
        row["met"] = met(row, ns) if row["nbytes"] >= ns.target_min_mb * 1e6 else None
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "bench_h2d",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()},
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "timing": "cuda events on the load stream" if cuda else "host clock (CPU: no meaning)",
        "peak": {"nbytes": peak_bytes, "gbps": peak, "ms": [t * 1e3 for t in peak_t]},
        "adapters": rows,
    }


def measure(packed: PackedAdapter, slots: LoraPool, timer: Timer, copy, cuda: bool, peak: float, ns) -> dict:
    """Plain copy of the same bytes; the slot copy as the worker issues it for a load no step runs early
    (one copy), then with the stream held until it is queued (DMA time only) and the host time to issue
    it behind a busy stream; and the layer-by-layer copy with events of overlapped loads."""
    same = timer.times(copy(packed.nbytes))
    slot_t = timer.times(lambda: slots.load(0, packed, [(0, packed.rank)], timer.stream))
    held = (
        timer.times(lambda: slots.load(0, packed, [(0, packed.rank)], timer.stream), hold=True)
        if cuda
        else None
    )
    issue = timer.issue(lambda: slots.load(0, packed, [(0, packed.rank)], timer.stream))
    layered = timer.times(lambda: slots.load(0, packed, [(0, packed.rank)], timer.stream, layer_events=True))
    got = slots.mem[:, : packed.rank].cpu()
    return {
        "name": packed.name,
        "rank": packed.rank,
        "nbytes": packed.nbytes,
        "num_layers": packed.block.shape[0],
        "tensor_pinned": packed.block.is_pinned(),
        "verified": bool(torch.equal(got, packed.block)),
        "same_size_gbps": gbps(packed.nbytes, same),
        "tensor_gbps": gbps(packed.nbytes, slot_t),
        "tensor_ratio": gbps(packed.nbytes, slot_t) / peak,
        "dma_only_gbps": gbps(packed.nbytes, held) if held else None,
        "layered_gbps": gbps(packed.nbytes, layered),
        "tensor_ms": [t * 1e3 for t in slot_t],
        "issue_ms_busy": statistics.median(issue) * 1e3,
    }


def measure_pool(adapters, rows, layout, slots: LoraPool, timer: Timer, cuda: bool, peak: float, dtype):
    """The same slot copies out of the shared-memory host pool, registered as pinned like the worker's."""
    pool = create_pool("lorapipe-h2d-", pool_bytes_for(layout, layout.max_rank, dtype, 1))
    registered = register_pinned(pool) if cuda else False
    try:
        for packed, row in zip(adapters, rows, strict=True):
            block_tensor(pool, 0, packed.rank, layout, dtype).copy_(packed.block)
            staged = packed_from_pool(pool, slot_load_of(packed, pool.name, layout), layout, dtype)
            t = timer.times(lambda staged=staged: slots.load(0, staged, [(0, staged.rank)], timer.stream))
            ok = torch.equal(slots.mem[:, : packed.rank].cpu(), packed.block)
            row.update(pool_pinned=staged.block.is_pinned(), pool_verified=bool(ok))
            row.update(pool_gbps=gbps(packed.nbytes, t), pool_ratio=gbps(packed.nbytes, t) / peak)
            row["pool_ms"] = [x * 1e3 for x in t]
            del staged
    finally:
        if cuda:
            torch.cuda.synchronize()
        if registered:
            unregister_pinned(pool)
        unlink_pool(pool)


def met(row: dict, ns: argparse.Namespace) -> bool:
    """Every measured slot path at >= target ratio of the peak and >= target GB/s."""
    paths = [k for k in ("tensor", "pool") if f"{k}_gbps" in row]
    return all(row[f"{k}_ratio"] >= ns.target_ratio and row[f"{k}_gbps"] >= ns.target_gbps for k in paths)


def format_table(report: dict[str, Any]) -> str:
    """Markdown: the peak, then one row per adapter size."""
    p = report["peak"]
    lines = [
        f"pinned→device peak ({report['device']}, {report['timing']}): {p['nbytes'] / 1e6:.0f} MB "
        f"buffer, median of {len(p['ms'])}: **{p['gbps']:.1f} GB/s**",
        "",
        "| adapter | rank | MB | same-size copy GB/s | slot GB/s (pinned tensor) | slot GB/s (host pool) "
        "| slot, DMA only GB/s | host ms to issue (stream busy) | layer by layer GB/s (overlapped loads) "
        "| × peak (tensor / pool) | target met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["adapters"]:
        pool = f"{r['pool_gbps']:.1f}" if "pool_gbps" in r else "-"
        ratio = f"{r['tensor_ratio']:.2f}" + (f" / {r['pool_ratio']:.2f}" if "pool_ratio" in r else "")
        dma = "-" if r["dma_only_gbps"] is None else f"{r['dma_only_gbps']:.1f}"
        verdict = {None: "n/a (small)", True: "yes", False: "**no**"}[r["met"]]
        bad = [k for k in ("verified", "pool_verified") if r.get(k) is False]
        verdict += f" (copy mismatch: {', '.join(bad)})" if bad else ""
        cells = [r["name"], str(r["rank"]), f"{r['nbytes'] / 1e6:.1f}"]
        cells += [f"{r['same_size_gbps']:.1f}", f"{r['tensor_gbps']:.1f}", pool, dma]
        cells += [f"{r['issue_ms_busy']:.3f}", f"{r['layered_gbps']:.1f}", ratio, verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sizes(text: str) -> list[float]:
    sizes = [float(s) for s in text.split(",") if s]
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive sizes in MB, e.g. 16,64,335; got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_h2d", description=__doc__)
    p.add_argument("--model", required=True, type=Path, metavar="DIR", help="reads only its config.json")
    p.add_argument("--sizes-mb", type=_sizes, default=[16.0, 64.0, 335.0], metavar="A,B", help="1 MB = 1e6 B")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, default=30, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-mb", type=float, default=1024.0, help="the plain pinned copy's buffer")
    p.add_argument("--no-pool", action="store_true", help="skip the shared-memory host pool path")
    p.add_argument("--target-ratio", type=float, default=0.85, help="slot GB/s over peak GB/s")
    p.add_argument("--target-gbps", type=float, default=46.0)
    p.add_argument("--target-min-mb", type=float, default=16.0, help="the targets apply from this size")
    p.add_argument("--work-dir", type=Path, default=None, help="where adapters are generated (temporary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, metavar="FILE", help="full results JSON")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.reps < 1 or ns.warmup < 0 or ns.peak_mb <= 0:
        p.error("need --reps >= 1, --warmup >= 0 and --peak-mb > 0")
    if not (ns.model / "config.json").is_file():
        p.error(f"--model {ns.model}: no config.json")
    report = run(ns)
    print(format_table(report))
    if ns.out:
        ns.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
