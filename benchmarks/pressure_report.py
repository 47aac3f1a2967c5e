"""The summary of `benchmarks/run_pressure_bench.sh`: one table over its passes (a pass cut by
its time limit is read from its progress line, so the requests it left unfinished are still counted),
the three memory-pressure targets with their verdicts, and the ERROR lines of each server log; all of
it also as OUT_DIR/summary.json. `python -m benchmarks.pressure_report OUT_DIR [--rate R]`."""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MIN_RATIO = 0.9  # tight output tok/s over roomy's
MAX_TTFT_P99_S = 1.0  # at the offered rate
PROGRESS = re.compile(r"(\d+)/(\d+) done, (\d+) in flight, (\d+) failed")


def read_pass(out: Path, label: str, server: str, status: str) -> dict[str, Any]:
    """One pass: its bench summary, or what its progress line says when it has none."""
    row: dict[str, Any] = {"pass": label, "server": server, "status": status}
    if status.startswith("skipped"):
        return row
    result = out / f"{label}.json"
    if result.exists() and not status.startswith("cut"):
        report = json.loads(result.read_text())
        s = report["summary"]
        errors = [r["error"] for r in report["requests"] if r["error"]]
        row.update(
            requests=s["num_requests"],
            completed=s["completed"],
            failed=s["failed"],
            # a stranded request ends by the per-reply timeout: it never finished
            not_finished=sum(e.startswith("Timeout") for e in errors),
            first_errors=sorted(set(errors))[:3],
            output_tok_s=s["output_throughput"],
            ttft_p50_s=s["ttft"]["p50"],
            ttft_p99_s=s["ttft"]["p99"],
            duration_s=s["duration_s"],
            adapter_loads=s.get("adapter_loads"),
            host_cache_hit_rate=s.get("host_cache_hit_rate"),
        )
        return row
    progress = out / f"{label}.progress"
    seen = PROGRESS.findall(progress.read_text(errors="replace")) if progress.exists() else []
    if seen:
        done, total, _, failed = map(int, seen[-1])
        row.update(requests=total, completed=done - failed, failed=failed + total - done)
        row["not_finished"] = total - done
    return row


def median_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def targets(rows: Sequence[dict[str, Any]], rate_label: str) -> list[dict[str, Any]]:
    by = {r["pass"]: r for r in rows}
    tight = [by[k] for k in ("p1_tight", "p4_tight") if k in by]
    roomy = [by[k] for k in ("p2_roomy", "p3_roomy") if k in by]
    out = []
    all_ok = bool(tight) and all(r.get("requests") and r.get("failed") == 0 for r in tight)
    done = [f"{r['pass']} {r.get('completed', '-')}/{r.get('requests', '-')}" for r in tight]
    what = "tight, saturation: every request successful"
    out.append({"target": what, "value": ", ".join(done), "met": all_ok})
    t, b = median_of(tight, "output_tok_s"), median_of(roomy, "output_tok_s")
    ratio = t / b if t is not None and b else None
    out.append(
        {
            "target": f"tight / roomy output tok/s (medians) >= {MIN_RATIO}",
            "value": None if ratio is None else round(ratio, 3),
            "met": ratio is not None and ratio >= MIN_RATIO and all_ok,
        }
    )
    r = by.get(rate_label, {})
    p99 = r.get("ttft_p99_s")
    out.append(
        {
            "target": f"{rate_label}: P99 TTFT <= {MAX_TTFT_P99_S} s and no request fails",
            "value": f"P99 TTFT {p99 if p99 is None else round(p99, 3)} s, {r.get('failed', '-')} failed",
            "met": p99 is not None and p99 <= MAX_TTFT_P99_S and r.get("failed") == 0,
        }
    )
    return out


def conditions(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the comparison assumes: the roomy server read nothing from disk in its passes (its cache held
    every adapter), and the tight one did (its cache was under pressure)."""
    by = {r["pass"]: r for r in rows}
    out = []
    for server, passes, want in (
        ("roomy", ("p2_roomy", "p3_roomy"), False),
        ("tight", ("p1_tight", "p4_tight"), True),
    ):
        loads = [by.get(k, {}).get("adapter_loads") for k in passes]
        seen = [x for x in loads if x is not None]
        held = "read adapters from disk" if want else "held every adapter (no disk loads)"
        out.append(
            {
                "condition": f"{server} {held}",
                "value": ", ".join(f"{k} {fmt(x, '.0f')}" for k, x in zip(passes, loads, strict=True)),
                "met": bool(seen) and (any(x > 0 for x in seen) if want else all(x == 0 for x in seen)),
            }
        )
    return out


def log_errors(out: Path) -> dict[str, dict[str, Any]]:
    """Per server log: how many ERROR lines, and the first few distinct ones."""
    res = {}
    for log in sorted(out.glob("server_*.log")):
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if " ERROR " in ln]
        distinct = list(dict.fromkeys(re.sub(r"^\S+ \S+ ", "", ln) for ln in lines))
        res[log.stem.removeprefix("server_")] = {"error_lines": len(lines), "first": distinct[:3]}
    return res


def fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: Sequence[dict[str, Any]]) -> str:
    cols = ["pass", "server", "status", "done / failed", "not finished", "out tok/s", "TTFT P50 / P99 s"]
    cols += ["disk loads", "host hit"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        done = f"{r['completed']} / {r['failed']}" if "completed" in r else "-"
        ttft = f"{fmt(r.get('ttft_p50_s'), '.3f')} / {fmt(r.get('ttft_p99_s'), '.3f')}"
        cells = [r["pass"], r["server"], r["status"], done, fmt(r.get("not_finished"), "d")]
        cells += [fmt(r.get("output_tok_s"), ",.0f"), ttft, fmt(r.get("adapter_loads"), ".0f")]
        cells.append(fmt(r.get("host_cache_hit_rate"), ".3f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pressure_report", description=__doc__)
    p.add_argument("out", type=Path, help="the script's OUT_DIR (passes.tsv, LABEL.json, server_*.log)")
    p.add_argument("--rate", default="40", help="the offered rate of the rate pass (its label)")
    ns = p.parse_args(argv)
    passes = [ln.split("\t") for ln in (ns.out / "passes.tsv").read_text().splitlines() if ln.strip()]
    rows = [read_pass(ns.out, label, server, status) for label, server, status in passes]
    verdicts = targets(rows, f"p5_tight_{ns.rate}rps")
    conds = conditions(rows)
    errors = log_errors(ns.out)
    print(table(rows))
    print()
    for v in verdicts:
        print(f"- {v['target']}: {v['value']} ({'met' if v['met'] else 'NOT met'})")
    for c in conds:
        print(f"- {c['condition']}: {c['value']} ({'yes' if c['met'] else 'NO'})")
    for r in rows:
        if r.get("first_errors"):
            print(f"- {r['pass']} errors: " + "; ".join(e[:200] for e in r["first_errors"]))
    for name, e in errors.items():
        print(f"- server {name}: {e['error_lines']} ERROR lines" + "".join(f"\n    {x}" for x in e["first"]))
    summary = {"passes": rows, "targets": verdicts, "conditions": conds, "server_errors": errors}
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(v["met"] for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
