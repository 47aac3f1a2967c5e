"""The first-burst benchmark's summary (benchmarks/run_first_burst_bench.sh): time to ready with a cold and a
warm compile cache, the warm-up's share read from the server logs, and each burst's throughput and TTFT;
the targets (first/second throughput, warm-cache time to ready) as PASS/FAIL lines. One markdown table
on stdout, everything in `--out` JSON.
    python -m benchmarks.first_burst_report --run "cold cache: first burst=first.json" ... \
        --out results.json"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_PLAN = re.compile(r"warm-up: (\d+) LoRA and (\d+) attention kernel variants")
_DONE = re.compile(r"warm-up done in ([0-9.]+) s")
_GRAPHS = re.compile(r"captured (\d+) decode CUDA graphs in ([0-9.]+) s")


def read_log(path: Path | None) -> dict[str, float | None]:
    """Warm-up variants and seconds, decode graphs and their capture seconds, from a server log."""
    text = path.read_text(errors="replace") if path is not None and path.exists() else ""
    plan, done, graphs = _PLAN.search(text), _DONE.search(text), _GRAPHS.search(text)
    return {
        "lora_variants": float(plan[1]) if plan else None,
        "attention_variants": float(plan[2]) if plan else None,
        "warmup_s": float(done[1]) if done else None,
        "graphs": float(graphs[1]) if graphs else None,
        "graph_capture_s": float(graphs[2]) if graphs else None,
    }


def _summary(path: Path) -> dict[str, Any]:
    s = json.loads(path.read_text())["summary"]
    return {
        "output_throughput": s["output_throughput"],
        "ttft_p50": s["ttft"]["p50"],
        "ttft_p95": s["ttft"]["p95"],
        "completed": s["completed"],
        "failed": s["failed"],
        "duration_s": s["duration_s"],
        "adapter_loads": s.get("adapter_loads"),  # disk→host reads during the burst (from /metrics)
    }


def _pair(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {spec!r}")
    return name, Path(path)


def _fmt(x: float | None, spec: str = "{:.1f}") -> str:
    return "-" if x is None else spec.format(x)


def build(ns: argparse.Namespace) -> dict[str, Any]:
    starts = {
        "cold": {"ready_s": ns.cold_ready, **read_log(ns.cold_log)},
        "warm": {"ready_s": ns.warm_ready, **read_log(ns.warm_log)},
    }
    runs = {name: _summary(path) for name, path in ns.run}
    first, second = runs.get(ns.first), runs.get(ns.second)
    ratio = None
    if first and second and second["output_throughput"]:
        ratio = first["output_throughput"] / second["output_throughput"]
    targets = {
        "first_over_second_throughput": {"value": ratio, "target": f">= {ns.min_ratio}"},
        "warm_cache_ready_s": {"value": ns.warm_ready, "target": f"<= {ns.max_warm_ready}"},
    }
    targets["first_over_second_throughput"]["pass"] = ratio is not None and ratio >= ns.min_ratio
    targets["warm_cache_ready_s"]["pass"] = ns.warm_ready is not None and ns.warm_ready <= ns.max_warm_ready
    return {"starts": starts, "runs": runs, "targets": targets}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| start | time to ready (s) | warm-up (s) | LoRA + attention variants | decode graphs (capture s) |",
        "|---|---|---|---|---|",
    ]
    for name, s in result["starts"].items():
        variants = (
            "-" if s["lora_variants"] is None else f"{s['lora_variants']:.0f} + {s['attention_variants']:.0f}"
        )
        graphs = "-" if s["graphs"] is None else f"{s['graphs']:.0f} ({s['graph_capture_s']:.1f})"
        lines.append(
            f"| {name} compile cache | {_fmt(s['ready_s'])} | {_fmt(s['warmup_s'])} | {variants} | {graphs} |"
        )
    lines += [
        "",
        "| burst | output tok/s | TTFT P50 / P95 (s) | completed / failed | duration (s) | adapter loads |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["runs"].items():
        ttft = f"{_fmt(r['ttft_p50'], '{:.2f}')} / {_fmt(r['ttft_p95'], '{:.2f}')}"
        lines.append(
            f"| {name} | {_fmt(r['output_throughput'])} | {ttft} | {r['completed']} / {r['failed']} | "
            f"{_fmt(r['duration_s'])} | {_fmt(r.get('adapter_loads'), '{:.0f}')} |"
        )
    lines.append("")
    for key, t in result["targets"].items():
        value = _fmt(t["value"], "{:.3f}")
        lines.append(f"- {key}: {value} (target {t['target']}): {'PASS' if t['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_burst_report", description=__doc__)
    p.add_argument("--cold-ready", type=float, help="seconds to ready with an empty compile cache")
    p.add_argument("--warm-ready", type=float, help="seconds to ready after a restart (warm cache)")
    p.add_argument("--cold-log", type=Path, help="server log of the cold start")
    p.add_argument("--warm-log", type=Path, help="server log of the warm restart")
    p.add_argument("--run", type=_pair, action="append", default=[], metavar="NAME=FILE", help="a burst")
    p.add_argument("--first", default="first burst", help="the --run name of the first burst")
    p.add_argument("--second", default="second burst", help="the --run name of the second burst")
    p.add_argument("--min-ratio", type=float, default=0.9, help="first/second output throughput target")
    p.add_argument("--max-warm-ready", type=float, default=30.0, help="warm-cache time-to-ready target (s)")
    p.add_argument("--out", type=Path, help="results JSON")
    ns = p.parse_args(argv)
    result = build(ns)
    print(table(result))
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
