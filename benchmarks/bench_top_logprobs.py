"""One step's top-k log-probabilities on the GPU: the fused kernel (`kernels/top_logprobs.py`) against the
torch ops it replaced (`reference`: float32 copy, logsumexp, topk, gather), device µs per call over
a sweep of rows (requests that ask) and k, on float32 logits of a real vocabulary; and the host µs of
turning one step's results into TokenLogprobs (`StepLogprobs.entries`). Every case checks that both
paths agree (ids exactly where no logits tie; values within 1e-4). Each case also times the kernel at
fixed vocabulary splits (1 to 64 chunks a row) against the heuristic's choice.

    python -m benchmarks.bench_top_logprobs OUT_DIR [--vocab 128256] [--rows 1,8,64,256] [--ks 1,5,20]
        [--iters 50]

Prints one table, writes OUT_DIR/top_logprobs.json."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.top_logprobs import reference, splits_for, top_logprobs  # noqa: E402
from stages.worker.token_logprobs import StepLogprobs  # noqa: E402


def device_us(fn, iters: int) -> float:
    """Median device µs of `fn` over `iters` calls, each between its own pair of events (on the CPU, a
    plumbing check under TRITON_INTERPRET=1: wall µs)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_us(rows: int, k: int, vocab: int, iters: int, dev: torch.device) -> float:
    """Median host µs of `entries()` for `rows` requests of top count k (results already on the host)."""
    logits = torch.randn(rows, vocab, device=dev)
    wanted = [(i, k) for i in range(rows)]
    idx = torch.arange(rows, device=dev)
    step = StepLogprobs(logits, idx, idx, wanted)
    step.to_host()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step.entries()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--ks", default="1,5,20")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    print("| rows | k | splits | torch µs | kernel µs | speed-up | best splits (µs) | entries() host µs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in map(int, a.rows.split(",")):
        logits = torch.randn(max(m, 1), a.vocab, device=dev) * 4  # [M, V] float32, as the runner returns
        rows = torch.randperm(m, device=dev)
        tokens = torch.randint(0, a.vocab, (m,), device=dev)
        for k in map(int, a.ks.split(",")):
            fused, torch_out = top_logprobs(logits, rows, tokens, k), reference(logits, rows, tokens, k)
            same_ids = torch.equal(fused[:, 1 + k :], torch_out[:, 1 + k :])
            diff = (fused[:, : 1 + k].view(torch.float32) - torch_out[:, : 1 + k].view(torch.float32)).abs()
            if not same_ids or float(diff.max()) > 1e-4:
                raise SystemExit(
                    f"rows {m} k {k}: the kernel and torch disagree (max diff {float(diff.max())})"
                )
            old = device_us(lambda: reference(logits, rows, tokens, k), a.iters)  # noqa: B023
            new = device_us(lambda: top_logprobs(logits, rows, tokens, k), a.iters)  # noqa: B023
            by_splits = {
                s: device_us(lambda: top_logprobs(logits, rows, tokens, k, s), a.iters)  # noqa: B023
                for s in (1, 2, 4, 8, 16, 64)
            }
            best = min(by_splits, key=by_splits.get)
            host = host_us(m, k, a.vocab, a.iters, dev)
            row = dict(rows=m, k=k, vocab=a.vocab, splits=splits_for(m, a.vocab, dev), torch_us=old)
            row |= dict(kernel_us=new, speedup=old / new, by_splits_us=by_splits, entries_host_us=host)
            results.append(row)
            print(
                f"| {m} | {k} | {row['splits']} | {old:.1f} | {new:.1f} | {old / new:.1f}x "
                f"| {best} ({by_splits[best]:.1f}) | {host:.1f} |",
                flush=True,
            )
    a.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    info = {"device": name, "torch": torch.__version__}
    (a.out / "top_logprobs.json").write_text(json.dumps({"info": info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
