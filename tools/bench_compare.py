"""Ratios of summary metrics between two bench reports of the same workload: candidate over baseline for
each `--metric` (`ttft.p50`, `e2e.p95`, `output_throughput`, ...), optionally with a bound on the ratio
(`ttft.p50<=0.6`, `output_throughput>=0.95`); prints one markdown table, `--out` writes JSON.
    python -m tools.bench_compare CAND.json BASE.json --metric 'ttft.p50<=0.6' --metric e2e.p95"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.bench_report import LATENCIES

SCHEMA_VERSION = 1
_SPEC = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(?:(<=|>=)\s*([0-9.eE+-]+))?\s*$")


class CompareError(ValueError):
    """The reports cannot be compared; the message says why."""


def metric_value(report: dict[str, Any], metric: str, name: str = "report") -> float:
    """`a.b` reads summary[a][b]; a plain key reads summary[key]."""
    node: Any = report.get("summary", {})
    for part in metric.split("."):
        if not isinstance(node, dict) or part not in node:
            raise CompareError(f"{name}: no summary value {metric!r}")
        node = node[part]
    if not isinstance(node, int | float):
        raise CompareError(f"{name}: summary value {metric!r} is {node!r}, not a number")
    return float(node)


def parse_spec(spec: str) -> tuple[str, str | None, float | None]:
    """`KEY`, `KEY<=X` or `KEY>=X` → (key, operator or None, bound or None)."""
    m = _SPEC.match(spec)
    if m is None:
        raise CompareError(f"--metric {spec!r}: expected KEY, KEY<=X or KEY>=X (e.g. ttft.p50<=0.6)")
    try:
        bound = None if m[3] is None else float(m[3])
    except ValueError:
        raise CompareError(f"--metric {spec!r}: {m[3]!r} is not a number") from None
    return m[1], m[2], bound


def compare(
    candidate: dict[str, Any],
    baseline: dict[str, Any],
    specs: Sequence[str],
    *,
    names: tuple[str, str] = ("candidate", "baseline"),
    same_workload: bool = True,
) -> dict[str, Any]:
    """One row per spec; `met` is None for a metric without a bound. Overall met: every bound holds."""
    if not specs:
        raise CompareError("no --metric given")
    digests = [r.get("workload", {}).get("sha256") for r in (candidate, baseline)]
    if same_workload and digests[0] != digests[1]:
        raise CompareError(f"{names[0]} and {names[1]} ran different workloads (sha256 {digests})")
    rows = []
    for spec in specs:
        key, op, bound = parse_spec(spec)
        c, b = metric_value(candidate, key, names[0]), metric_value(baseline, key, names[1])
        ratio = c / b if b else None
        met = None
        if op is not None:
            met = ratio is not None and (ratio <= bound if op == "<=" else ratio >= bound)
        row = {
            "metric": key,
            "candidate": c,
            "baseline": b,
            "ratio": ratio,
            "bound": op and f"{op} {bound:g}",
        }
        rows.append({**row, "met": met})
    warnings = [
        f"{name}: {r['summary'].get('failed')} requests failed"
        for name, r in zip(names, (candidate, baseline), strict=True)
        if r.get("summary", {}).get("failed")
    ]
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "bench_compare",
        "candidate": {"file": names[0], "label": candidate.get("label", "")},
        "baseline": {"file": names[1], "label": baseline.get("label", "")},
        "rows": rows,
        "met": all(r["met"] is not False for r in rows),
        "warnings": warnings,
    }


def _value(metric: str, x: float) -> str:
    return f"{x * 1e3:.1f} ms" if metric.split(".")[0] in LATENCIES else f"{x:.4g}"


def format_markdown(result: dict[str, Any]) -> str:
    cand, base = (result[k]["label"] or result[k]["file"] for k in ("candidate", "baseline"))
    lines = [
        f"| metric | {cand} | {base} | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        target = (r["bound"] or "-").replace("<=", "≤").replace(">=", "≥")
        met = {None: "-", True: "yes", False: "**no**"}[r["met"]]
        cells = [r["metric"], _value(r["metric"], r["candidate"]), _value(r["metric"], r["baseline"])]
        lines.append("| " + " | ".join([*cells, ratio, target, met]) + " |")
    lines += [f"- warning: {w}" for w in result["warnings"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m tools.bench_compare", description=__doc__)
    p.add_argument("candidate", type=Path, metavar="CAND.json")
    p.add_argument("baseline", type=Path, metavar="BASE.json")
    p.add_argument(
        "--metric", action="append", default=[], metavar="SPEC", help="KEY, KEY<=RATIO or KEY>=RATIO (repeat)"
    )
    p.add_argument("--allow-different-workloads", action="store_true", help="skip the sha256 check")
    p.add_argument("--out", type=Path, metavar="FILE", help="write the comparison as JSON")
    ns = p.parse_args(argv)
    try:
        cand, base = (json.loads(f.read_text()) for f in (ns.candidate, ns.baseline))
        result = compare(
            cand,
            base,
            ns.metric,
            names=(str(ns.candidate), str(ns.baseline)),
            same_workload=not ns.allow_different_workloads,
        )
    except (OSError, json.JSONDecodeError, CompareError) as exc:
        p.error(f"{type(exc).__name__}: {exc}")
    print(format_markdown(result))
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
