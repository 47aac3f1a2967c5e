"""Disk→host leg of adapter loads: the loader's path (header plan, then the file's parts, each read,
checked and packed into a block of the shared-memory host pool, on a thread pool or with `--writers N`
on N part-writer processes, as the adapter-loader runs them, then the effective-delta check) against a
plain read of the same file into a reused buffer, per adapter rank, for one load at a time and for N
loads at once (aggregate). Page cache warm (each file read once first); `--cold` also drops each file's
pages before every timed read (posix_fadvise, no root needed; tmpfs keeps its pages). Medians of
`--reps`. Rates in GB/s (1e9 B/s) of packed bytes (the block: what the issue's targets count) and of
file bytes. Reads the model's config.json only (or `--preset`); adapters are generated. One table; JSON
with `--out`.
    python -m benchmarks.bench_loader [--model DIR | --preset 1b] [--ranks 8,16,32,64] [--writers N] \
        [--out F]"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from runtime.common.host_pool import ALIGN, block_tensor, create_pool, unlink_pool
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype
from runtime.host_cache_size import default_loader_threads
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import PRESETS, build_config
from stages.loader.adapter_plan import ReadLimits
from stages.loader.adapter_reader import plan_adapter, read_adapter
from stages.loader.block_writer import SegmentBuffer, prepare, write_part, zero_gaps
from stages.loader.delta_bound import check_packed_deltas
from stages.loader.process import SWITCH_INTERVAL_S, tune_for_loads
from stages.loader.writers import PartWriters

SCHEMA_VERSION = 1
FILE = "adapter_model.safetensors"


class Loads:
    """Adapter loads as the loader runs them: each load planned on its own driver thread (the actor's
    load loops), every part of every plan run by one pool of `threads` threads, into disjoint blocks of
    one shared-memory pool."""

    def __init__(self, cfg: ModelConfig, layout: LoraLayout, dtype: torch.dtype, ns: argparse.Namespace):
        threads, slots = ns.threads, ns.parallel
        self.cfg, self.layout, self.dtype = cfg, layout, dtype
        self.limits = ReadLimits(
            segment_bytes=int(ns.segment_mb * 2**20),
            read_bytes=int(ns.read_mb * 2**20),
            tasks=ns.tasks or ns.writers or threads,
        )
        self.buffers = [SegmentBuffer() for _ in range(slots)]
        self.slot_bytes = (layout.block_bytes(layout.max_rank, dtype) + ALIGN - 1) // ALIGN * ALIGN
        self.pool = create_pool("lorapipe-benchload-", self.slot_bytes * slots)
        whole = torch.frombuffer(self.pool.buf, dtype=torch.uint8)
        whole.zero_()  # fault the pages in once, as in a pool that has served for a while
        del whole
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="bench-loader")
        self.drivers = ThreadPoolExecutor(slots, thread_name_prefix="bench-load")

    def block(self, slot: int, rank: int) -> torch.Tensor:
        return block_tensor(self.pool, slot * self.slot_bytes, rank, self.layout, self.dtype)

    def run(self, paths: Sequence[Path]) -> None:
        for f in wait([self.drivers.submit(self._one, slot, p) for slot, p in enumerate(paths)]).done:
            f.result()

    def _one(self, slot: int, path: Path) -> None:
        with plan_adapter(path.name, path, self.cfg, self.layout, self.dtype, self.limits) as plan:
            block, buf = self.block(slot, plan.rank), self.buffers[slot]
            first: list[tuple] = [(zero_gaps, plan, block)]
            for s, seg in enumerate(plan.segments):
                prepare(plan, s, buf)
                self._all(first + [(write_part, plan, s, i, buf, block) for i in range(len(seg.parts))])
                first = []
            check = (check_packed_deltas, plan.name, self.layout, block, plan.ranks, plan.scalings, plan.peak)
            self._all([check])

    def _all(self, calls: list[tuple]) -> None:
        for f in wait([self.executor.submit(*call) for call in calls]).done:
            f.result()

    def close(self) -> None:
        self.drivers.shutdown()
        self.executor.shutdown()
        unlink_pool(self.pool)


class WriterLoads(Loads):
    """Adapter loads as the loader runs them with part-writer processes: each load planned on a thread,
    every part of every load handed to an idle writer, the effective-delta check on a thread."""

    def __init__(self, cfg: ModelConfig, layout: LoraLayout, dtype: torch.dtype, ns: argparse.Namespace):
        super().__init__(cfg, layout, dtype, ns)
        self.tasks = ns.tasks
        self.dir = tempfile.mkdtemp(prefix="bench-writers-")
        self.loop = asyncio.new_event_loop()
        log = logging.getLogger("bench_loader")
        self.writers = PartWriters(ns.writers, f"ipc://{self.dir}/w.sock", self.pool.name, log)
        self.loop.run_until_complete(self.writers.start())

    def run(self, paths: Sequence[Path]) -> None:
        # as the loader cuts them: a part per writer for a load alone, at least two each for loads at once
        tasks = self.tasks or max(2, self.writers.count // len(paths))
        limits = dataclasses.replace(self.limits, tasks=tasks)

        async def all_loads() -> None:
            await asyncio.gather(*[self._load(slot, p, limits) for slot, p in enumerate(paths)])

        self.loop.run_until_complete(all_loads())

    async def _load(self, slot: int, path: Path, limits: ReadLimits) -> None:
        loop = asyncio.get_running_loop()
        plan = await loop.run_in_executor(
            self.drivers, plan_adapter, path.name, path, self.cfg, self.layout, self.dtype, limits
        )
        with plan:
            parts = [(s, i) for s, seg in enumerate(plan.segments) for i in range(len(seg.parts))]
            offset = slot * self.slot_bytes
            writes = [
                self.writers.write(plan, plan.path, offset, s, i, [] if k else plan.gaps)
                for k, (s, i) in enumerate(parts)
            ]
            await asyncio.gather(*writes)
            check = (
                plan.name,
                self.layout,
                self.block(slot, plan.rank),
                plan.ranks,
                plan.scalings,
                plan.peak,
            )
            await loop.run_in_executor(self.executor, check_packed_deltas, *check)

    def close(self) -> None:
        self.writers.close()
        pending = asyncio.all_tasks(self.loop)  # cancelled by close(): let them end
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        super().close()


def plain_read(paths: Sequence[Path], buffers: list[bytearray], executor: ThreadPoolExecutor) -> None:
    """Each file into its own reused buffer with positioned reads, files on parallel threads."""

    def read(path: Path, buf: bytearray) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            view, done = memoryview(buf), 0
            while done < len(buf) and (n := os.preadv(fd, [view[done:]], done)) > 0:
                done += n
        finally:
            os.close(fd)

    for f in wait([executor.submit(read, p, b) for p, b in zip(paths, buffers, strict=True)]).done:
        f.result()


def drop_cache(paths: Sequence[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], None], reps: int, before: Callable[[], None] | None = None) -> list[float]:
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def rate(nbytes: int, seconds: Sequence[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def measure(rank: int, copies: list[Path], loads: Loads, reader: ThreadPoolExecutor, ns) -> dict[str, Any]:
    file_bytes = (copies[0] / FILE).stat().st_size
    files = [c / FILE for c in copies]
    one, many = copies[:1], copies[: ns.parallel]
    bufs = [bytearray(file_bytes) for _ in many]
    plain_read(files[: ns.parallel], bufs, reader)  # warm: page cache and buffers
    loads.run(many)
    with plan_adapter("probe", one[0], loads.cfg, loads.layout, loads.dtype) as probe:
        packed_bytes = probe.nbytes
    row: dict[str, Any] = {"rank": rank, "file_bytes": file_bytes, "packed_bytes": packed_bytes}
    row["plain_s"] = timed(lambda: plain_read(files[:1], bufs[:1], reader), ns.reps)
    row["load_s"] = timed(lambda: loads.run(one), ns.reps)
    row["plain_parallel_s"] = timed(lambda: plain_read(files[: ns.parallel], bufs, reader), ns.reps)
    row["load_parallel_s"] = timed(lambda: loads.run(many), ns.reps)
    if ns.cold:
        drop = lambda: drop_cache(files)
        row["plain_cold_s"] = timed(lambda: plain_read(files[:1], bufs[:1], reader), ns.reps, drop)
        row["load_cold_s"] = timed(lambda: loads.run(one), ns.reps, drop)
    want = read_adapter("ref", one[0], loads.cfg, loads.layout, loads.dtype).block
    row["verified"] = all(torch.equal(loads.block(i, rank), want) for i in range(ns.parallel))
    n = ns.parallel
    row.update(
        plain_gbps=rate(file_bytes, row["plain_s"]),
        load_gbps=rate(packed_bytes, row["load_s"]),
        load_file_gbps=rate(file_bytes, row["load_s"]),
        plain_parallel_gbps=rate(n * file_bytes, row["plain_parallel_s"]),
        load_parallel_gbps=rate(n * packed_bytes, row["load_parallel_s"]),
        load_parallel_file_gbps=rate(n * file_bytes, row["load_parallel_s"]),
    )
    if ns.cold:
        row.update(plain_cold_gbps=rate(file_bytes, row["plain_cold_s"]))
        row.update(load_cold_gbps=rate(packed_bytes, row["load_cold_s"]))
    big = packed_bytes >= ns.target_min_mb * 1e6
    row["met"] = {
        "single": row["load_gbps"] >= ns.target_single_gbps if big else None,
        "parallel": row["load_parallel_gbps"] >= ns.target_parallel_gbps if big else None,
    }
    return row


def run(ns: argparse.Namespace) -> dict[str, Any]:
    tune_for_loads(ns.switch_interval_ms / 1e3)  # as the loader process does
    with tempfile.TemporaryDirectory(prefix="bench_loader-", dir=ns.work_dir) as work:
        model = ns.model
        if model is None:
            model = Path(work) / "model"
            model.mkdir()
            (model / "config.json").write_text(json.dumps(build_config("llama", ns.preset)))
        cfg = ModelConfig.from_dir(model)
        dtype = parse_dtype(ns.dtype, cfg.dtype)
        layout = LoraLayout.for_model(cfg, max(ns.ranks))
        loads = WriterLoads(cfg, layout, dtype, ns) if ns.writers else Loads(cfg, layout, dtype, ns)
        reader = ThreadPoolExecutor(ns.parallel)
        rows = []
        try:
            for r in ns.ranks:
                made = make_adapters(
                    model, Path(work), n=1, ranks=(r,), dtype=ns.adapter_dtype, prefix=f"r{r}_"
                )
                first = made[0]
                copies = [first] + [Path(work) / f"r{r}_copy{i}" for i in range(1, ns.parallel)]
                for c in copies[1:]:
                    shutil.copytree(first, c)
                rows.append(measure(r, copies, loads, reader, ns))
                for c in copies:
                    shutil.rmtree(c)
        finally:
            reader.shutdown()
            loads.close()
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "bench_loader",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()},
        "model": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "row_elems": layout.row_elems},
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__},
        "serving_dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
    }


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    n = c["parallel"]
    lines = [
        f"disk→host ({report['host']['cpus']} cpus, {c['threads']} loader threads, {c['writers']} writer "
        f"processes, {c['adapter_dtype']} "
        f"files → {report['serving_dtype']} blocks, page cache warm, median of {c['reps']}); GB/s of packed "
        "bytes (of file bytes in brackets)",
        "",
        f"| rank | file MB | packed MB | plain read | load | {n} plain reads | {n} loads (aggregate) "
        f"| cold: plain / load | verified | target met (single / {n}×) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        cold = f"{r['plain_cold_gbps']:.2f} / {r['load_cold_gbps']:.2f}" if "load_cold_gbps" in r else "-"
        met = " / ".join({None: "n/a", True: "yes", False: "**no**"}[v] for v in r["met"].values())
        cells = [str(r["rank"]), f"{r['file_bytes'] / 1e6:.1f}", f"{r['packed_bytes'] / 1e6:.1f}"]
        cells += [f"({r['plain_gbps']:.2f})", f"**{r['load_gbps']:.2f}** ({r['load_file_gbps']:.2f})"]
        cells += [f"({r['plain_parallel_gbps']:.2f})"]
        cells += [f"**{r['load_parallel_gbps']:.2f}** ({r['load_parallel_file_gbps']:.2f})", cold]
        cells += ["yes" if r["verified"] else "**NO**", met]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    values = [int(s) for s in text.split(",") if s]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, e.g. 8,16,32,64; got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_loader", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, metavar="DIR", help="reads only its config.json")
    src.add_argument("--preset", choices=sorted(PRESETS), default="1b", help="model shape when no --model")
    p.add_argument("--ranks", type=_ints, default=[8, 16, 32, 64], metavar="R,R")
    p.add_argument("--adapter-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--threads", type=int, default=default_loader_threads(), help="loader threads")
    p.add_argument("--parallel", type=int, default=None, help="loads at once (default: --threads)")
    p.add_argument("--writers", type=int, default=0, help="part-writer processes (0: the threads write)")
    p.add_argument(
        "--tasks",
        type=int,
        default=None,
        help="parts one load is cut into (default: --writers, else --threads)",
    )
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--segment-mb", type=float, default=ReadLimits.segment_bytes / 2**20, help="held at once")
    p.add_argument("--read-mb", type=float, default=ReadLimits.read_bytes / 2**20, help="bytes per read")
    p.add_argument(
        "--switch-interval-ms", type=float, default=SWITCH_INTERVAL_S * 1e3, help="GIL switch interval"
    )
    p.add_argument("--cold", action="store_true", help="also time reads after dropping each file's pages")
    p.add_argument("--target-single-gbps", type=float, default=2.0)
    p.add_argument("--target-parallel-gbps", type=float, default=4.0)
    p.add_argument("--target-min-mb", type=float, default=20.0, help="the targets apply from this size")
    p.add_argument("--work-dir", type=Path, default=None, help="where adapters are generated (temporary)")
    p.add_argument("--out", type=Path, metavar="FILE", help="full results JSON")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    ns = p.parse_args(argv)
    ns.parallel = ns.parallel or ns.threads
    if ns.reps < 1 or ns.threads < 1 or ns.parallel < 1 or ns.segment_mb <= 0 or ns.read_mb <= 0:
        p.error("need --reps, --threads and --parallel >= 1, --segment-mb and --read-mb > 0")
    if ns.model is not None and not (ns.model / "config.json").is_file():
        p.error(f"--model {ns.model}: no config.json")
    report = run(ns)
    print(format_table(report))
    if ns.out:
        ns.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
