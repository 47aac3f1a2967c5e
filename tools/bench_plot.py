"""`--plot FILE.png` for the benchmarks: CDFs of TTFT, ITL and end-to-end latency, and a timeline of
requests in flight with the server's cumulative adapter loads. Needs matplotlib (imported here only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def in_flight(records: list[dict[str, Any]]) -> tuple[list[float], list[int]]:
    """Step function of requests between start and end: (times, counts after each time)."""
    events = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records])
    times, counts, n = [0.0], [0], 0
    for t, step in events:
        n += step
        times.append(t)
        counts.append(n)
    return times, counts


def _cdf(ax: Any, values: list[float], title: str) -> None:
    xs = sorted(v * 1e3 for v in values)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib (pip install matplotlib): {exc}") from None
    ok = [r for r in report["requests"] if r["error"] is None]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _cdf(axes[0][0], [r["ttft"] for r in ok if r["ttft"] is not None], "TTFT")
    _cdf(axes[0][1], [x for r in ok for x in r["itl"]], "inter-token latency")
    _cdf(axes[1][0], [r["e2e"] for r in ok if r["e2e"] is not None], "end-to-end latency")
    ax = axes[1][1]
    times, counts = in_flight(report["requests"])
    ax.step(times, counts, where="post", label="requests in flight", color="tab:blue")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("requests in flight")
    ax.set_title("timeline")
    timeline = (report.get("server_metrics") or {}).get("timeline") or []
    if timeline:
        loads = ax.twinx()
        t = [p["t"] for p in timeline]
        for key, color, name in (
            ("adapter_loads", "tab:red", "adapter loads, disk→host"),
            ("slot_loads", "tab:green", "copies into the GPU pool"),
        ):
            if timeline[0].get(key) is not None:
                base = timeline[0][key]
                loads.plot(t, [p[key] - base for p in timeline], color=color, label=name)
        loads.set_ylabel("cumulative loads")
        loads.legend(loc="upper right")
    ax.legend(loc="upper left")
    fig.suptitle(f"{report['tool']}: {report['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
