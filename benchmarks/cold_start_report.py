"""The cold-start benchmark's summary (benchmarks/run_cold_start_bench.sh): time to ready per server, the
warm-up's share and its compile counts from the server logs, the bursts' throughput, and the targets as
PASS/FAIL lines; then, per server, where every second to ready went (`timeline`: the launcher's and the
worker's start-up lines on one clock, the scheduler's Ready and the health check that saw it, the rest
as "unattributed"). Markdown tables on stdout, everything in `--out` JSON.
    python -m benchmarks.cold_start_report OUT_DIR --min-ratio 0.95 --out OUT_DIR/results.json"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_DONE = re.compile(
    r"warm-up done in ([0-9.]+) s: (\d+) of (\d+) kernels compiled by the pool, (\d+) of (\d+)"
)
_PLAN = re.compile(r"warm-up: (\d+) LoRA and (\d+) attention kernel variants")
_GRAPHS = re.compile(r"captured (\d+) (?:decode|\w+ step) CUDA graphs.*? in ([0-9.]+) s")
# the launcher's and the worker's own timestamps (runtime/launcher.py, stages/worker/actor.py)
_SPAWNED = re.compile(r"stages spawned ([0-9.]+) s after launch(?: \((.*)\))?")
_WORKER_READY = re.compile(r"stage 'worker' ready \(pid \d+\) ([0-9.]+) s after launch")
_SCHEDULER_READY = re.compile(r"stage 'scheduler' ready \(pid \d+\) ([0-9.]+) s after launch")
_STARTUP = re.compile(r"worker INFO start-up: (.*)")
# the worker's parts, in order (stages/worker/actor.py `_log_startup`)
_WORKER_PARTS = re.compile(
    r"process started ([0-9.]+) s after launch, ([0-9.]+) s before the model runner"
    r"(?: \(([0-9.]+) s of it waiting for its config\))?; (.*?); after the runner: (.*?); "
    r"WorkerStarted sent ([0-9.]+) s after launch"
)
_PART = re.compile(r"([^,;()]+?) (-?[0-9.]+) s(?:, |$)")
_READ = re.compile(r"compiled in the worker, ([0-9.]+) s reading kernels from the cache")
_PINNED = re.compile(r"host cache pinned \(\d+ MiB\) in ([0-9.]+) s")
SERVERS = {
    "mixed_cold": "a. 96 adapters r8/16/32/64, empty cache",
    "r16_cold": "b. 32 rank-16 adapters, empty cache",
    "mixed_prebuilt": "c. as a, on a `lorapipe warmup` cache",
    "s1_cold": "s1. 2,000 rank-16 adapters, empty cache",
}
BURSTS = {"mixed_cold": "mixed", "s1_cold": "s1"}


def parts_of(text: str) -> list[tuple[str, float]]:
    """ "name 1.20 s, other 0.30 s" as [(name, seconds)], in order."""
    return [(name.strip(), float(s)) for name, s in _PART.findall(text)]


def timeline(log: dict[str, Any], ready_s: float) -> list[tuple[str, float]] | None:
    """Where the seconds from launch to a client's first "ready" went, in order; they add up to `ready_s`
    (the last part, "unattributed", is what the lines do not cover). None without the worker's line."""
    w = log.get("worker_timeline")
    if w is None:
        return None
    launcher = log.get("launcher_parts") or "-"
    out = [(f"launch to the worker's process (launcher: {launcher})", w["started"])]
    out += [("worker: imports and actor", w["before"])]
    out += [("worker: waiting for the launcher's config", w.get("config_wait", 0.0))]
    out += [(f"worker: {name}", s) for name, s in w["runner"] + w["after"]]
    attributed = sum(s for _, s in out)
    scheduler = log.get("scheduler_ready_s")
    if scheduler is not None:
        handshake = scheduler - w["sent"]
        out.append(("scheduler's Ready after WorkerStarted (planner; the loader if later)", handshake))
        out.append(("health seen ok by the client after the scheduler's Ready", ready_s - scheduler))
        attributed += handshake + ready_s - scheduler
    out.append(("unattributed", ready_s - attributed))
    return out


def read_log(path: Path) -> dict[str, Any]:
    text = path.read_text(errors="replace") if path.exists() else ""
    done, plan = _DONE.search(text), _PLAN.search(text)
    spawned, worker, startup = _SPAWNED.search(text), _WORKER_READY.search(text), _STARTUP.search(text)
    pinned, read = _PINNED.search(text), _READ.search(text)
    scheduler, parts = _SCHEDULER_READY.search(text), _WORKER_PARTS.search(text)
    worker_timeline = None
    if parts:
        wait = float(parts[3] or 0.0)
        worker_timeline = {
            "started": float(parts[1]),
            "before": float(parts[2]) - wait,  # the interpreter, the imports and the actor
            "config_wait": wait,  # a prestarted worker's wait for the launcher's hand-over
            "runner": parts_of(parts[4]),
            "after": parts_of(parts[5]),
            "sent": float(parts[6]),
        }
    return {
        "launcher_parts": spawned[2] if spawned and spawned[2] else None,
        "scheduler_ready_s": float(scheduler[1]) if scheduler else None,
        "worker_timeline": worker_timeline,
        "variants": int(plan[1]) + int(plan[2]) if plan else None,
        "warmup_s": float(done[1]) if done else None,
        "pool_compiled": int(done[2]) if done else None,
        # recorded for the pool; without one (the cache held them all), those the launches loaded
        "kernels": (int(done[3]) or int(done[5])) if done else None,
        "spawned_s": float(spawned[1]) if spawned else None,
        "worker_ready_s": float(worker[1]) if worker else None,
        "startup": startup[1].strip() if startup else None,
        "host_cache_pinned_s": float(pinned[1]) if pinned else None,  # beside the runner's build
        "cache_read_s": float(read[1]) if read else None,  # of the warm-up's launch pass
        "worker_compiled": int(done[4]) if done else None,
        "graph_capture_s": sum(float(s) for _, s in _GRAPHS.findall(text)) or None,
    }


def _throughput(path: Path) -> float | None:
    return json.loads(path.read_text())["summary"]["output_throughput"] if path.exists() else None


def build(out: Path, min_ratio: float) -> dict[str, Any]:
    ready: dict[str, float] = {}
    if (out / "ready.txt").exists():
        for line in (out / "ready.txt").read_text().split():
            k, _, v = line.partition("=")
            ready[k] = float(v)
    rows = {}
    for key, label in SERVERS.items():
        if key not in ready:
            continue
        row = {"label": label, "ready_s": ready[key], **read_log(out / f"server_{key}.log")}
        row["timeline"] = timeline(row, ready[key])
        if key in BURSTS:
            first, second = (_throughput(out / f"{BURSTS[key]}_{n}.json") for n in ("first", "second"))
            row.update(
                first_tok_s=first, second_tok_s=second, ratio=first / second if first and second else None
            )
        rows[key] = row
    weights = ready.get("weights_read_s")
    checks = []

    def check(name: str, value: float | None, ok: bool) -> None:
        checks.append({"target": name, "value": value, "pass": bool(ok)})

    if "mixed_cold" in rows:
        check("a: ready <= 30 s", rows["mixed_cold"]["ready_s"], rows["mixed_cold"]["ready_s"] <= 30)
    if "r16_cold" in rows:
        check("b: ready <= 20 s", rows["r16_cold"]["ready_s"], rows["r16_cold"]["ready_s"] <= 20)
    if "mixed_prebuilt" in rows and weights is not None:
        c = rows["mixed_prebuilt"]
        check("c: ready - weight read <= 10 s", c["ready_s"] - weights, c["ready_s"] - weights <= 10)
        check(
            "c: nothing compiled at start",
            c["pool_compiled"],
            c["pool_compiled"] == c["worker_compiled"] == 0,
        )
    for key in BURSTS:
        if rows.get(key, {}).get("ratio") is not None:
            check(
                f"{key}: first/second burst >= {min_ratio}",
                rows[key]["ratio"],
                rows[key]["ratio"] >= min_ratio,
            )
    return {
        "servers": rows,
        "weights_read_s": weights,
        "warmup_cli_s": ready.get("warmup_cli_s"),
        "checks": checks,
    }


def _fmt(x: Any, spec: str = "{:.1f}") -> str:
    return "-" if x is None else spec.format(x)


def table(r: dict[str, Any]) -> str:
    lines = [
        "| server | ready s | warm-up s | variants | kernels | compiled: pool / worker | graphs s | "
        "burst 1 tok/s | burst 2 tok/s | 1st/2nd |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["servers"].values():
        lines.append(
            f"| {row['label']} | {_fmt(row['ready_s'])} | {_fmt(row['warmup_s'])} "
            f"| {_fmt(row['variants'], '{}')} "
            f"| {_fmt(row['kernels'], '{}')} | {_fmt(row['pool_compiled'], '{}')} / "
            f"{_fmt(row['worker_compiled'], '{}')} | {_fmt(row['graph_capture_s'])} "
            f"| {_fmt(row.get('first_tok_s'), '{:.0f}')} | {_fmt(row.get('second_tok_s'), '{:.0f}')} "
            f"| {_fmt(row.get('ratio'), '{:.3f}')} |"
        )
    lines.append("")
    lines.append(
        f"weights read: {_fmt(r['weights_read_s'], '{:.2f}')} s; "
        f"`lorapipe warmup`: {_fmt(r['warmup_cli_s'])} s"
    )
    for row in r["servers"].values():
        if row.get("spawned_s") is not None or row.get("startup"):
            spawned, worker = _fmt(row.get("spawned_s"), "{:.2f}"), _fmt(row.get("worker_ready_s"), "{:.2f}")
            lines.append(
                f"{row['label']}: stages spawned at {spawned} s, worker ready at {worker} s (launcher's "
                f"clock); host cache pinned in {_fmt(row.get('host_cache_pinned_s'))} s beside the runner; "
                f"warm-up read kernels from the cache for {_fmt(row.get('cache_read_s'))} s; "
                f"worker {row.get('startup') or '-'}"
            )
    lines += [
        f"{'PASS' if c['pass'] else 'FAIL'} {c['target']}: {_fmt(c['value'], '{:.3f}')}" for c in r["checks"]
    ]
    for row in r["servers"].values():
        if row.get("timeline"):
            lines += ["", f"Where {row['label']}'s {row['ready_s']:.2f} s to ready went:", "", "| part | s |"]
            lines += ["|---|---|"] + [f"| {name} | {s:.2f} |" for name, s in row["timeline"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="the benchmark's output directory")
    p.add_argument("--min-ratio", type=float, default=0.95, help="first/second burst target")
    p.add_argument("--out", type=Path, required=True, help="results JSON")
    ns = p.parse_args(argv)
    r = build(ns.dir, ns.min_ratio)
    ns.out.write_text(json.dumps(r, indent=2))
    print(table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
