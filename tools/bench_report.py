"""Benchmark results shared by bench_serving and bench_peft: per-request records, the summary (latency
percentiles, throughput, server counters), the one summary table, the JSON file, and a markdown table
over several result files: `python -m tools.bench_report A.json B.json [--baseline C.json]`."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools import roofline

SCHEMA_VERSION = 1
LATENCIES = ("ttft", "itl", "tpot", "e2e")


@dataclass
class RequestRecord:
    """One workload line's outcome. Times are seconds; `arrival` and `start` count from the run's start,
    `ttft` and `e2e` from `start` (bench_serving: the send) or from `arrival` (bench_peft)."""

    index: int  # line of the workload file (0-based)
    adapter: str | None
    arrival: float
    max_tokens: int
    start: float = 0.0  # sent to the server / its batch started
    end: float = 0.0  # its last token arrived / its batch finished (or it failed)
    prompt_tokens: int = 0
    output_tokens: int = 0  # tokens the server (or generate) returned
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # output_tokens - 1 gaps; ttft + sum(itl) <= e2e
    finish_reason: str | None = None
    error: str | None = None
    request_id: str | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


class Progress:
    """A one-line `\\r` progress bar on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.t0 = total, enabled, time.monotonic()
        self.done = self.failed = self.in_flight = 0

    def show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        width = 30
        fill = width * self.done // max(self.total, 1)
        line = (
            f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} done, "
            f"{self.in_flight} in flight, {self.failed} failed, {time.monotonic() - self.t0:.1f}s"
        )
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()


def jsonable(args: dict[str, Any]) -> dict[str, Any]:
    """Parsed arguments as JSON values: paths as strings, infinities (an unbounded rate) as null."""
    out = {}
    for k, v in args.items():
        out[k] = str(v) if isinstance(v, Path) else (None if isinstance(v, float) and math.isinf(v) else v)
    return out


def percentiles(xs: Sequence[float]) -> dict[str, float | None]:
    """mean, P50, P95, P99 (linear interpolation between order statistics); None when empty."""
    if not xs:
        return {"mean": None, "p50": None, "p95": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo = math.floor(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s), "p50": q(0.50), "p95": q(0.95), "p99": q(0.99)}


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """Latency and throughput over the run; failed requests count only in `failed`."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    lat = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "e2e": [r.e2e for r in ok if r.e2e is not None],
        "itl": [x for r in ok for x in r.itl],
        "tpot": [
            (r.e2e - r.ttft) / (r.output_tokens - 1)
            for r in ok
            if r.output_tokens > 1 and r.e2e is not None and r.ttft is not None
        ],
    }
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        **{k: percentiles(v) for k, v in lat.items()},
    }


def make_report(
    tool: str,
    label: str,
    config: dict[str, Any],
    workload: dict[str, Any],
    records: Sequence[RequestRecord],
    duration: float,
    server: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document both tools write: the tool's arguments (`config`), the workload's source, size and
    sha256, the summary (latency percentiles in seconds, throughputs, the server's derived counters), the
    server's counters at start and end with their timeline (`server_metrics`), and every request's
    record. Readers check `schema_version`."""
    summary = summarize(records, duration)
    summary.update((server or {}).get("derived", {}))
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": tool,
        "label": label,
        "config": config,
        "workload": workload,
        "summary": summary,
        "server_metrics": server,
        "requests": [asdict(r) for r in records],
    }


def write_report(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def emit_report(report: dict[str, Any], ns: argparse.Namespace) -> None:
    """What both benchmarks do with a finished report: the table (unless --quiet), --out, --plot."""
    if not ns.quiet:
        print(format_table(report))
    if ns.out:
        write_report(report, ns.out)
    if ns.plot:
        from tools.bench_plot import plot_report

        plot_report(report, ns.plot)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else (fmt.format(x) if isinstance(x, float) else str(x))


def format_table(report: dict[str, Any]) -> str:
    """The one summary table printed at the end of a run."""
    s = report["summary"]
    rows = [
        ("Requests completed / failed", f"{s['completed']} / {s['failed']}"),
        ("Duration (s)", _num(s["duration_s"])),
        ("Input / output tokens", f"{s['input_tokens']} / {s['output_tokens']}"),
        ("Request throughput (req/s)", _num(s["request_throughput"])),
        ("Output token throughput (tok/s)", _num(s["output_throughput"])),
        ("Total token throughput (tok/s)", _num(s["total_token_throughput"])),
    ]
    for key, name in (
        ("adapter_loads", "Adapter loads, disk→host"),
        ("bytes_loaded", "Bytes loaded, disk→host"),
        ("host_cache_hit_rate", "Host-cache hit rate"),
        ("slot_loads", "Adapter copies into the GPU pool"),
        ("gpu_slot_hit_rate", "GPU-pool hit rate"),
    ):
        if key in s:
            rows.append((name, _num(s[key], "{:.3f}" if "rate" in key else "{:.0f}")))
    if (s.get("gpu_slot_hit_rate_source") or "").startswith("estimate"):
        rows[-1] = (rows[-1][0] + " (estimated)", rows[-1][1])
    for key, what in (("adapter_wait", "Adapter wait"), ("queue_wait", "Queue wait")):
        if s.get(f"{key}s"):
            waits = [_num(s.get(f"{key}_{q}_s"), "{:.3f}") for q in ("p50", "p95", "p99")]
            rows.append((f"{what} P50/P95/P99 (s), {s[key + 's']:.0f} waits", " / ".join(waits)))
    rf = s.get("roofline")
    if rf:
        gb = [_num(rf[k] / 1e9, "{:.1f}") for k in ("weight_bytes", "adapter_bytes", "kv_bytes")]
        rows.append(("Bytes read: weights / adapters / KV (GB)", " / ".join(gb)))
        if rf.get("floor_s"):
            bw = rf["bandwidth_Bps"] / 1e9
            rows.append(
                (
                    f"Bytes floor at {bw:.0f} GB/s (s), share of duration",
                    f"{rf['floor_s']:.2f}, {rf['floor_fraction']:.3f}",
                )
            )
    width = max(len(k) for k, _ in rows) + 4
    title = f" {report['tool']}: {report['label']} "
    lines = [title.center(width + 40, "=")]
    lines += [f"{k:<{width}}{v:>40}" for k, v in rows]
    lines.append(f"{'latency (ms)':<{width}}{'mean':>10}{'P50':>10}{'P95':>10}{'P99':>10}")
    for key in LATENCIES:
        p = s[key]
        lines.append(
            f"{key.upper():<{width}}" + "".join(f"{_ms(p[q]):>10}" for q in ("mean", "p50", "p95", "p99"))
        )
    lines.append("=" * (width + 40))
    return "\n".join(lines)


MD_COLUMNS = (
    "run",
    "rate (req/s)",
    "done/failed",
    "req/s",
    "out tok/s",
    "× baseline",
    "bytes bound × baseline",
    "fraction of the bound",
    "TTFT P50/P95 (ms)",
    "ITL P50/P95 (ms)",
    "E2E P50/P95 (ms)",
    "host hit",
    "pool hit",
)


def against_baseline(report: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, float | None]:
    """The measured throughput ratio against `baseline`, the best ratio its bytes allow
    (`tools.roofline.bound_ratio`, when both runs carry a roofline) and the measured one's fraction of it."""
    s = report["summary"]
    b = baseline["summary"] if baseline else None
    ratio = s["output_throughput"] / b["output_throughput"] if b and b["output_throughput"] else None
    bound = None
    if b and s.get("roofline") and b.get("roofline"):
        bound = roofline.bound_ratio(
            s["roofline"], s["output_tokens"], b["roofline"], b["output_tokens"], b["duration_s"]
        )
    return {"ratio": ratio, "bound": bound, "fraction": roofline.fraction_of_bound(ratio, bound)}


def markdown_row(report: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    s, c = report["summary"], report["config"]
    vs = against_baseline(report, baseline)
    cells = [
        report["label"],
        _num(c.get("request_rate"), "{:.3g}"),
        f"{s['completed']}/{s['failed']}",
        _num(s["request_throughput"]),
        _num(s["output_throughput"], "{:.1f}"),
        _num(vs["ratio"], "{:.2f}×"),
        _num(vs["bound"], "{:.2f}×"),
        _num(vs["fraction"], "{:.2f}"),
        *(f"{_ms(s[k]['p50'])} / {_ms(s[k]['p95'])}" for k in ("ttft", "itl", "e2e")),
        _num(s.get("host_cache_hit_rate"), "{:.3f}"),
        _num(s.get("gpu_slot_hit_rate"), "{:.3f}"),
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_table(reports: Sequence[dict[str, Any]], baseline: dict[str, Any] | None = None) -> str:
    head = ["| " + " | ".join(MD_COLUMNS) + " |", "|" + "---|" * len(MD_COLUMNS)]
    return "\n".join(head + [markdown_row(r, baseline) for r in reports])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench_report", description=__doc__)
    p.add_argument("results", nargs="+", metavar="JSON")
    p.add_argument(
        "--baseline",
        metavar="JSON",
        help="'× baseline' divides output tok/s by this run's; with rooflines in both (bench_serving "
        "--model), the bytes bound against it and the fraction of that bound",
    )
    ns = p.parse_args(argv)
    reports = [json.loads(Path(f).read_text()) for f in ns.results]
    baseline = json.loads(Path(ns.baseline).read_text()) if ns.baseline else None
    print(markdown_table(reports, baseline))


if __name__ == "__main__":
    main()
