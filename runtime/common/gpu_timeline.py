"""GPU-busy share of a torch.profiler Chrome trace: the union of device activity (kernels, memcpy, memset;
overlapping streams counted once) against the window's wall time, the GPU-idle gaps (how many, how long,
the largest with the host operations running across them) and device time by kernel family and by
kernel (the `top` largest). Used by
`benchmarks/gpu_timeline.py` on any saved trace, and by the worker's step profiler (`--profile-steps`) as
`python -m runtime.common.gpu_timeline TRACE.json WALL_US`, which compresses the trace to TRACE.json.gz
and prints the summary as JSON: in a process of its own, so parsing a large trace never takes the GIL
from a serving worker."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver"})
FAMILIES = (  # (family, substrings of the kernel name), first match wins
    ("lora shrink", ("lora_shrink",)),
    ("lora expand", ("lora_expand",)),
    ("attention", ("attention", "attn", "flash")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")),
    ("memcpy/memset", ("memcpy", "memset")),
)
GAP_BINS_US = (10, 100, 1_000, 10_000)


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of [start, end) intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of [start, end) that `busy` (merged) leaves idle."""
    out, t = [], start
    for s, e in busy:
        if s > t:
            out.append((t, min(s, end)))
        t = max(t, e)
    if t < end:
        out.append((t, end))
    return [(s, e) for s, e in out if e > s]


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "other")


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict[str, Any]], wall_us: float | None = None, top: int = 10) -> dict[str, Any]:
    """`wall_us`: the window's wall time (default: first to last event of the trace)."""
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    device = [e for e in timed if e.get("cat") in DEVICE_CATS]
    host = [e for e in timed if e.get("cat") in HOST_CATS]
    if not timed:
        raise ValueError("the trace has no timed events")
    start = min(float(e["ts"]) for e in timed)
    end = max(float(e["ts"]) + float(e["dur"]) for e in timed)
    if wall_us is not None:
        end = start + wall_us
    busy = merge((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device)
    busy_us = sum(e - s for s, e in busy)
    idle = gaps(busy, start, end)
    by_family: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    for e in device:
        name = str(e.get("name", ""))
        fam = family(name)
        by_family[fam] = by_family.get(fam, 0.0) + float(e["dur"])
        by_kernel[name[:100]] = by_kernel.get(name[:100], 0.0) + float(e["dur"])
    hist = {f"< {b} us": 0 for b in GAP_BINS_US} | {f">= {GAP_BINS_US[-1]} us": 0}
    for s, e in idle:
        d = e - s
        key = next((f"< {b} us" for b in GAP_BINS_US if d < b), f">= {GAP_BINS_US[-1]} us")
        hist[key] += 1
    largest = sorted(idle, key=lambda g: g[0] - g[1])[:top]
    return {
        "window_us": end - start,
        "device_busy_us": busy_us,
        "busy_share": busy_us / (end - start) if end > start else 0.0,
        "device_events": len(device),
        "idle_gaps": len(idle),
        "idle_gap_histogram": hist,
        "device_us_by_family": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
        "device_us_top_kernels": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]),
        "largest_gaps": [
            {"start_us": s - start, "us": e - s, "host": _host_during(host, s, e)} for s, e in largest
        ],
    }


def _host_during(host: list[dict[str, Any]], s: float, e: float, limit: int = 4) -> list[str]:
    """The shortest host operations that cover the gap's middle: what the host was doing then."""
    mid = (s + e) / 2
    cover = [h for h in host if float(h["ts"]) <= mid <= float(h["ts"]) + float(h["dur"])]
    cover.sort(key=lambda h: float(h["dur"]))
    return [f"{h.get('name', '?')} ({float(h['dur']) / 1e3:.2f} ms)" for h in cover[:limit]]


def report(s: dict[str, Any]) -> str:
    lines = [
        f"window {s['window_us'] / 1e6:.3f} s, GPU busy {s['device_busy_us'] / 1e6:.3f} s: "
        f"**{100 * s['busy_share']:.1f} %** ({s['device_events']} device events, {s['idle_gaps']} idle gaps)",
        "",
        "| idle gap | count |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in s["idle_gap_histogram"].items()),
        "",
        "| device time by family | s | share of busy |",
        "| --- | --- | --- |",
    ]
    busy = s["device_busy_us"] or 1.0
    for fam, us in s["device_us_by_family"].items():
        lines.append(f"| {fam} | {us / 1e6:.3f} | {100 * us / busy:.1f} % |")
    lines += ["", "| kernel (top by device time) | s | share of busy |", "| --- | --- | --- |"]
    for name, us in s.get("device_us_top_kernels", {}).items():
        lines.append(f"| `{name}` | {us / 1e6:.3f} | {100 * us / busy:.1f} % |")
    lines += ["", "| largest idle gaps: at (s) | ms | host operations across it |", "| --- | --- | --- |"]
    for g in s["largest_gaps"]:
        lines.append(f"| {g['start_us'] / 1e6:.3f} | {g['us'] / 1e3:.2f} | {'; '.join(g['host']) or '-'} |")
    return "\n".join(lines)


def compress_and_summarize(plain: Path, wall_us: float) -> dict[str, Any]:
    """Gzip `plain` (a Chrome trace) to `plain`.gz, remove `plain`, and summarize the trace."""
    packed = plain.with_name(plain.name + ".gz")
    with plain.open("rb") as src, gzip.open(packed, "wb", compresslevel=3) as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()
    return summarize(load_trace(packed), wall_us)


if __name__ == "__main__":
    print(json.dumps(compress_and_summarize(Path(sys.argv[1]), float(sys.argv[2]))))
