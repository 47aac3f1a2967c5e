"""The table and targets of benchmarks/run_prefix_bench.sh: each pass's completions, TTFT, throughput and
prefix-cache hit rate (the server's counters after the pass minus after its previous pass), then the
cached/plain ratios against the targets. Writes OUT_DIR/summary.json; exit 1 when a target is missed.
`python -m benchmarks.prefix_report OUT_DIR`"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

TARGETS = {  # (workload, measure): (bound, "min" | "max") on cached / plain
    ("prefix", "output_throughput"): (2.5, "min"),
    ("prefix", "ttft_p50"): (0.3, "max"),
    ("distinct", "output_throughput"): (0.98, "min"),
}
_SAMPLE = re.compile(r"^(lorapipe_prefix_cache_(?:hits|queries)_total)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


def counters(path: Path) -> dict[str, float]:
    """The prefix-cache counters a pass's metrics file holds, summed over their label sets."""
    out: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            m = _SAMPLE.match(line)
            if m:
                out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def passes(out: Path) -> list[dict]:
    """Every measured pass, in the order it ran, with its summary and its hit rate."""
    rows, last = [], {}
    for line in (out / "passes.tsv").read_text().splitlines():
        label, server, status = line.split("\t")
        now = counters(out / f"{label}.metrics")
        before = last.get(server, {})
        last[server] = now
        if label.startswith("warmup"):
            continue
        queried = now.get("lorapipe_prefix_cache_queries_total", 0) - before.get(
            "lorapipe_prefix_cache_queries_total", 0
        )
        hit = now.get("lorapipe_prefix_cache_hits_total", 0) - before.get(
            "lorapipe_prefix_cache_hits_total", 0
        )
        path = out / f"{label}.json"
        s = json.loads(path.read_text())["summary"] if path.exists() else None
        rows.append(
            dict(label=label, server=server, status=status, workload=label.split("_")[0], summary=s,
                 hit_rate=hit / queried if queried else 0.0)
        )  # fmt: skip
    return rows


def measure(s: dict, name: str) -> float:
    return s["ttft"]["p50"] if name == "ttft_p50" else s[name]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    out = p.parse_args(argv).out
    rows = passes(out)
    print("| pass | server | completed | TTFT P50 / P95 ms | output tok/s | req/s | prefix hit rate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        s = r["summary"]
        if s is None:
            print(f"| {r['label']} | {r['server']} | {r['status']} | - | - | - | - |")
            continue
        ttft = s["ttft"]
        print(
            f"| {r['label']} | {r['server']} | {s['completed']}/{s['num_requests']} | "
            f"{(ttft['p50'] or 0) * 1e3:.0f} / {(ttft['p95'] or 0) * 1e3:.0f} | "
            f"{s['output_throughput']:.0f} | "
            f"{s['request_throughput']:.2f} | {r['hit_rate']:.1%} |"
        )
    results, ok = [], all(r["summary"] and r["summary"]["failed"] == 0 for r in rows)
    print("\n| workload | measure | cached / plain (medians of passes) | target | met |")
    print("| --- | --- | --- | --- | --- |")
    for (workload, name), (bound, kind) in TARGETS.items():
        vals = {
            server: [measure(r["summary"], name) for r in rows if r["workload"] == workload
                     and r["server"] == server and r["summary"] and r["summary"]["completed"]]
            for server in ("cached", "plain")
        }  # fmt: skip
        if not (vals["cached"] and vals["plain"]):
            ratio, met = None, False
        else:
            ratio = statistics.median(vals["cached"]) / statistics.median(vals["plain"])
            met = ratio >= bound if kind == "min" else ratio <= bound
        ok &= met
        shown = "-" if ratio is None else f"{ratio:.3f}"
        sign = ">=" if kind == "min" else "<="
        print(f"| {workload} | {name} | {shown} | {sign} {bound} | {'yes' if met else 'NO'} |")
        results.append(dict(workload=workload, measure=name, ratio=ratio, bound=bound, kind=kind, met=met))
    print(f"\nevery request completed and every target met: {'yes' if ok else 'NO'}")
    (out / "summary.json").write_text(json.dumps(dict(passes=rows, targets=results, ok=ok), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
