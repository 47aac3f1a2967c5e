"""Profiles one decode step of the worker's model runner: host wall time vs GPU time per step, with
and without adapters, eager and replayed as a CUDA graph, and the torch profiler's top operations of the
eager steps. Prints one table; `--out` writes JSON. `--distinct 1,2,4` measures the LoRA cases once per
count of distinct adapters in the batch (sequence i uses adapter i % K) in one process, the base-only
cases once, and writes one JSON per count (`--out` then names a pattern with `{k}`).
    python benchmarks/profile_step.py --model DIR --adapter-dir DIR [--batch 64] [--ctx 256] [--steps 20]"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import re
import time
from pathlib import Path

import torch

from stages.loader.adapter_reader import read_adapter
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput


def _step_times(runner: ModelRunner, seqs: list[SeqInput], steps: int) -> tuple[float, float]:
    """Median host wall ms and GPU ms of `runner.execute(seqs)` (the same decode, repeated)."""
    walls, gpus = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        runner.execute(seqs)
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        gpus.append(start.elapsed_time(end))
    return sorted(walls)[len(walls) // 2], sorted(gpus)[len(gpus) // 2]


def _device_total_ms(table: str) -> float | None:
    """The profiler table's "Self CUDA time total" (every kernel once; summing the per-op rows would
    count a kernel under its op and again as itself)."""
    m = re.search(r"Self (?:CUDA|device) time total: ([0-9.]+)(us|ms|s)\b", table)
    if m is None:
        return None
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]


def _host_profile(runner: ModelRunner, seqs: list[SeqInput], steps: int) -> str:
    """cProfile of `steps` executions (synchronized at the end only): the top 25 by own time."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        runner.execute(seqs)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--adapter-dir", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--slots", type=int, default=32, help="adapters resident in the GPU pool")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the pool's largest rank")
    p.add_argument("--lora-gpu-memory-gb", type=float, default=None, help="the pool's size (default 10%%)")
    p.add_argument(
        "--mix-prefill", type=int, default=0, metavar="N",
        help="add N prefill tokens to each decode step, in chunks of 256, each chunk its own adapter",
    )  # fmt: skip
    p.add_argument(
        "--prefill", action="store_true", help="each sequence computes its whole ctx (a prefill step)"
    )
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also run N steps of each eager case under cProfile: the host functions with the "
                   "most own time")  # fmt: skip
    p.add_argument("--distinct", default=None, metavar="K1,K2,...",
                   help="sweep: the LoRA cases for each count of distinct adapters (loads the largest count; "
                   "overrides --slots); --out must contain {k}")  # fmt: skip
    p.add_argument("--out")
    a = p.parse_args(argv)
    sweep = [int(k) for k in a.distinct.split(",")] if a.distinct else None
    if sweep is not None:
        if min(sweep) < 1:
            p.error("--distinct: every count must be at least 1")
        if a.out and "{k}" not in a.out:
            p.error("--out must contain {k} with --distinct (one JSON per count)")
        a.slots = max(sweep)
    if a.prefill and a.batch * a.ctx > 2048:
        p.error("--prefill: batch * ctx must be at most 2048 (the runner's max_tokens_per_step)")
    if a.prefill and a.mix_prefill:
        p.error("--prefill and --mix-prefill exclude each other")
    chunks = [min(256, a.mix_prefill - i) for i in range(0, a.mix_prefill, 256)]
    step_tokens = a.batch * a.ctx if a.prefill else a.batch + a.mix_prefill
    pages_per = max(a.ctx, 256 if chunks else 0) // 16 + 2
    cfg = RunnerConfig(model_dir=a.model, device="cuda", dtype="bfloat16",
                       max_lora_rank=a.max_lora_rank, lora_gpu_memory_gb=a.lora_gpu_memory_gb,
                       num_pages=(a.batch + len(chunks)) * pages_per + 16, max_model_len=pages_per * 16,
                       max_tokens_per_step=max(2048, step_tokens), max_running_requests=a.batch + len(chunks),
                       cuda_graph_max_batch=a.batch,
                       cuda_graph_max_tokens=step_tokens if a.prefill or a.mix_prefill else 0)  # fmt: skip
    runner = ModelRunner(cfg)
    dirs = sorted(d for d in Path(a.adapter_dir).iterdir() if d.is_dir())[: a.slots]
    row = 0
    for slot, d in enumerate(dirs):
        packed = read_adapter(d.name, d, runner.model_cfg, runner.lora_layout, runner.dtype, pin_memory=True)
        runner.load_adapter(slot, packed, [(row, packed.rank)])  # side by side in the pool
        row += packed.rank
    graphs, steps = runner.graphs, runner.step_graphs
    base = _cases(a, runner, chunks, pages_per, (("base-only", None, False), ("base-only graph", None, True)))
    for k in sweep or [len(dirs)]:
        k = min(k, len(dirs))
        results = dict(base)
        results.update(_cases(a, runner, chunks, pages_per, (("lora", k, False), ("lora graph", k, True))))
        results = {n: results[n] for n in ("base-only", "lora", "base-only graph", "lora graph")}
        _report(a, results, graphs, steps, k, sweep is not None)


def _cases(a, runner: ModelRunner, chunks: list[int], pages_per: int, cases) -> dict[str, dict]:
    """Measure each (label, distinct adapters or None for base-only, graphed) case: median wall and GPU ms,
    and for eager cases the profiler's table (unless sweeping)."""
    results = {}
    graphs, steps = runner.graphs, runner.step_graphs
    for label, k, graphed in cases:
        slot_of = (lambda i: -1) if k is None else (lambda i, k=k: i % k)
        runner.graphs = graphs if graphed else None  # decode steps
        runner.step_graphs = steps if graphed else None  # prefill steps
        new = a.ctx if a.prefill else 1
        seqs = [
            SeqInput([7] * new, a.ctx + 1 - new, list(range(i * pages_per, (i + 1) * pages_per)), slot_of(i))
            for i in range(a.batch)
        ]
        seqs += [  # prefill chunks from the start of their sequences
            SeqInput([7] * n, 0, list(range((a.batch + j) * pages_per, (a.batch + j + 1) * pages_per)),
                     slot_of(a.batch + j))
            for j, n in enumerate(chunks)
        ]  # fmt: skip
        seqs.sort(key=lambda s: s.slot)  # each adapter's tokens contiguous
        _step_times(runner, seqs, 3)  # warm-up: Triton compiles, allocator settles
        wall, gpu = _step_times(runner, seqs, a.steps)
        results[label] = {"wall_ms": wall, "gpu_ms": gpu}
        what = f"prefills of {a.ctx}" if a.prefill else f"decodes at ctx {a.ctx}"
        what += f" + {a.mix_prefill} prefill tokens" if a.mix_prefill else ""
        print(f"\n=== {label}: {a.batch} {what}: host wall {wall:.2f} ms, GPU {gpu:.2f} ms")
        if graphed or a.distinct:
            continue
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            runner.execute(seqs)
            torch.cuda.synchronize()
        if a.cprofile:
            results[label]["cprofile"] = _host_profile(runner, seqs, a.cprofile)
            print(results[label]["cprofile"])
        averages = prof.key_averages()
        table = averages.table(sort_by="self_cpu_time_total", row_limit=15)
        kernel_ms = _device_total_ms(table)
        results[label]["profile"] = table
        results[label]["kernel_ms"] = kernel_ms
        print(f"GPU kernel time (profiler): {kernel_ms} ms")
        print(table)
    runner.graphs, runner.step_graphs = graphs, steps
    return results


def _report(a, results: dict, graphs, steps, k: int, sweep: bool) -> None:
    if sweep:
        print(f"\n##### {k} distinct adapters in a batch of {a.batch}")
    if graphs is not None:
        n, secs = len(graphs.graphs), graphs.capture_seconds
        print(f"decode graphs captured: {n} in {secs:.2f} s; replays {graphs.replays}")
    if steps is not None:
        n, secs = steps.num_graphs, steps.capture_seconds
        print(f"step graphs captured: {n} in {secs:.2f} s; replays {steps.replays}")
    print(f"\n{'case':<16} {'wall ms':>8} {'gpu ms':>8} {'kernels ms':>10}")
    for label, r in results.items():
        kernels = f"{r['kernel_ms']:10.2f}" if r.get("kernel_ms") is not None else f"{'-':>10}"
        print(f"{label:<16} {r['wall_ms']:8.2f} {r['gpu_ms']:8.2f} {kernels}")
    if a.out:
        args = {**vars(a), "slots": k}
        out = Path(a.out.replace("{k}", str(k)))
        out.write_text(json.dumps({"args": args, "results": results}, indent=1))


if __name__ == "__main__":
    main()
