"""Decode ITL of requests on resident adapters while other adapters load, against the same workload run
with no loads: pools the inter-token latencies of the requests whose adapter is in `--adapters` over one
or more bench_serving reports per side (repeats, e.g. in A-B-B-A order, cancel drift between runs),
compares a percentile (P95 by default), prints one markdown table (each run, then the pooled sides),
`--out` writes JSON.
    python -m benchmarks.itl_under_load --loads L1.json [L2.json] --quiet Q1.json [Q2.json] \
        --adapters a0,a1"""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from tools.bench_report import percentiles

SCHEMA_VERSION = 1
STATS = ("p50", "p95", "p99")


class ItlError(ValueError):
    """The reports cannot be compared; the message says which file and why."""


def resident_itls(report: dict[str, Any], adapters: Collection[str]) -> tuple[list[float], int, int]:
    """ITL samples of the successful requests on `adapters`, their count, and failed ones on them."""
    mine = [r for r in report["requests"] if r["adapter"] in adapters]
    ok = [r for r in mine if r["error"] is None]
    return [x for r in ok for x in r["itl"]], len(ok), len(mine) - len(ok)


def run_summary(report: dict[str, Any], adapters: Collection[str], name: str) -> dict[str, Any]:
    """One report's resident ITLs and counters; raises ItlError when it has nothing to compare."""
    if report.get("tool") != "bench_serving" or "requests" not in report:
        raise ItlError(f"{name}: not a bench_serving report (tool {report.get('tool')!r})")
    itls, n_ok, n_failed = resident_itls(report, adapters)
    if not itls:
        seen = sorted({str(r["adapter"]) for r in report["requests"]})
        raise ItlError(
            f"{name}: no inter-token latencies from successful requests on {sorted(adapters)}; "
            f"the report's adapters are {seen}"
        )
    s = report.get("summary", {})
    return {
        "file": name,
        "label": report.get("label", ""),
        "sha256": report.get("workload", {}).get("sha256"),
        "requests": n_ok,
        "failed": n_failed,
        "itl_samples": len(itls),
        "itl": percentiles(itls),
        "slot_loads": s.get("slot_loads"),  # copies into the GPU pool during the run (server counter)
        "samples": itls,
    }


def pooled(runs: Sequence[dict[str, Any]], label: str) -> dict[str, Any]:
    """One side: every run's samples together (each run stays in `runs`, without its samples)."""
    samples = [x for r in runs for x in r["samples"]]
    loads = [r["slot_loads"] for r in runs]
    return {
        "label": label,
        "requests": sum(r["requests"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "itl_samples": len(samples),
        "itl": percentiles(samples),
        "slot_loads": None if None in loads else sum(loads),
        "runs": [{k: v for k, v in r.items() if k != "samples"} for r in runs],
    }


def compare(
    loads: dict[str, Any] | Sequence[dict[str, Any]],
    quiet: dict[str, Any] | Sequence[dict[str, Any]],
    adapters: Collection[str],
    *,
    stat: str = "p95",
    tolerance: float = 0.05,
    names: tuple[Sequence[str], Sequence[str]] | None = None,
    same_workload: bool = True,
) -> dict[str, Any]:
    """Ratio of the resident requests' ITL `stat` with loads over without (each side pooled over its
    reports); met when <= 1 + tolerance. `warnings` lists what makes the measurement doubtful."""
    if stat not in STATS:
        raise ItlError(f"stat {stat!r}: expected one of {', '.join(STATS)}")
    if not adapters:
        raise ItlError("no resident adapters given")
    sides = [
        [loads] if isinstance(loads, dict) else list(loads),
        [quiet] if isinstance(quiet, dict) else list(quiet),
    ]
    if not sides[0] or not sides[1]:
        raise ItlError("need at least one report with loads and one without")
    if names is None:
        names = tuple(
            [f"{key}{i + 1}" for i in range(len(side))]
            for key, side in zip(("loads", "quiet"), sides, strict=True)
        )
    runs = [
        [run_summary(r, adapters, n) for r, n in zip(side, side_names, strict=True)]
        for side, side_names in zip(sides, names, strict=True)
    ]
    digests = {r["sha256"] for side in runs for r in side}
    if same_workload and len(digests) > 1:
        raise ItlError(
            f"the reports ran different workloads (sha256 {sorted(map(str, digests))}); "
            "the comparison needs the identical workload"
        )
    warnings = []
    for r in runs[0]:
        if r["slot_loads"] == 0:
            warnings.append(
                f"{r['file']}: no adapter was copied into a slot, so nothing loaded during the run"
            )
    for r in runs[1]:
        if r["slot_loads"]:
            warnings.append(f"{r['file']}: {r['slot_loads']:.0f} slot copies during a run meant to have none")
    for r in runs[0] + runs[1]:
        if r["failed"]:
            warnings.append(f"{r['file']}: {r['failed']} resident requests failed")
        if r["slot_loads"] is None:
            warnings.append(f"{r['file']}: no server counters (run bench_serving with --metrics-url)")
    a, b = pooled(runs[0], "with loads (pooled)"), pooled(runs[1], "no loads (pooled)")
    ratio = a["itl"][stat] / b["itl"][stat] if b["itl"][stat] else None
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "itl_under_load",
        "adapters": sorted(adapters),
        "stat": stat,
        "tolerance": tolerance,
        "loads": a,
        "quiet": b,
        "ratio": ratio,
        "met": ratio is not None and ratio <= 1.0 + tolerance,
        "warnings": warnings,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def format_markdown(result: dict[str, Any]) -> str:
    """Each run, the pooled sides (when a side has several runs), and the verdict line."""
    stat = result["stat"]
    lines = [
        "| run | resident requests | ITL samples | slot copies "
        "| ITL mean (ms) | ITL P50 (ms) | ITL P95 (ms) | ITL P99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(s: dict[str, Any], name: str) -> str:
        loads = "-" if s["slot_loads"] is None else f"{s['slot_loads']:.0f}"
        cells = [name, str(s["requests"]), str(s["itl_samples"]), loads]
        return "| " + " | ".join(cells + [_ms(s["itl"][q]) for q in ("mean", *STATS)]) + " |"

    for key in ("loads", "quiet"):
        side = result[key]
        lines += [row(r, r["label"] or r["file"]) for r in side["runs"]]
        if len(side["runs"]) > 1:
            lines.append(row(side, f"**{side['label']}**"))
    ratio = "-" if result["ratio"] is None else f"{result['ratio']:.3f}"
    verdict = "met" if result["met"] else "not met"
    lines += [
        "",
        f"ITL {stat.upper()} of requests on {', '.join(result['adapters'])}, with loads / without: {ratio} "
        f"(target ≤ {1 + result['tolerance']:.2f}: {verdict})",
    ]
    lines += [f"- warning: {w}" for w in result["warnings"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.itl_under_load", description=__doc__)
    p.add_argument("--loads", type=Path, nargs="+", required=True, metavar="JSON", help="runs with loads")
    p.add_argument("--quiet", type=Path, nargs="+", required=True, metavar="JSON", help="the same, no loads")
    p.add_argument("--adapters", required=True, metavar="A,B", help="the resident adapters' names")
    p.add_argument("--stat", choices=STATS, default="p95")
    p.add_argument("--tolerance", type=float, default=0.05, help="met when ratio <= 1 + this")
    p.add_argument("--allow-different-workloads", action="store_true", help="skip the sha256 check")
    p.add_argument("--out", type=Path, metavar="FILE", help="write the comparison as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    ns = p.parse_args(argv)
    adapters = [a for a in ns.adapters.split(",") if a]
    try:
        loads, quiet = ([json.loads(f.read_text()) for f in files] for files in (ns.loads, ns.quiet))
        result = compare(
            loads,
            quiet,
            adapters,
            stat=ns.stat,
            tolerance=ns.tolerance,
            names=([str(f) for f in ns.loads], [str(f) for f in ns.quiet]),
            same_workload=not ns.allow_different_workloads,
        )
    except (OSError, json.JSONDecodeError, KeyError, ItlError) as exc:
        p.error(f"{type(exc).__name__}: {exc}")
    print(format_markdown(result))
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
