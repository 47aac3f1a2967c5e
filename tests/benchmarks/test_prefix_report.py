"""The prefix benchmark's report: per-pass hit rates from the counters' growth on each server, the
cached/plain ratios (medians of passes) against the targets, and its exit status."""

from __future__ import annotations

import json

from benchmarks import prefix_report


def _pass(out, label: str, server: str, tput: float, ttft: float, hits: float, queries: float) -> str:
    s = dict(output_throughput=tput, request_throughput=tput / 128, ttft={"p50": ttft, "p95": 2 * ttft},
             completed=10, failed=0, num_requests=10)  # fmt: skip
    (out / f"{label}.json").write_text(json.dumps({"summary": s}))
    (out / f"{label}.metrics").write_text(
        f'lorapipe_prefix_cache_hits_total{{stage="scheduler"}} {hits}\n'
        f'lorapipe_prefix_cache_queries_total{{stage="scheduler"}} {queries}\n'
    )
    return f"{label}\t{server}\tok\n"


def _write(out, prefix_tput: float) -> None:
    rows = [
        _pass(out, "warmup_cached", "cached", 1, 1, 100, 200),
        _pass(out, "warmup_plain", "plain", 1, 1, 0, 0),
        _pass(out, "distinct_1_cached", "cached", 990, 1.0, 100, 400),
        _pass(out, "distinct_1_plain", "plain", 1000, 1.0, 0, 0),
        _pass(out, "distinct_2_plain", "plain", 1000, 1.0, 0, 0),
        _pass(out, "distinct_2_cached", "cached", 1000, 1.0, 100, 600),
        _pass(out, "prefix_1_cached", "cached", prefix_tput, 0.2, 900, 1600),
        _pass(out, "prefix_1_plain", "plain", 1000, 1.0, 0, 0),
    ]
    (out / "passes.tsv").write_text("".join(rows))


def test_ratios_hit_rates_and_targets(tmp_path, capsys):
    _write(tmp_path, 3000)
    assert prefix_report.main([str(tmp_path)]) == 0
    got = json.loads((tmp_path / "summary.json").read_text())
    rates = {r["label"]: r["hit_rate"] for r in got["passes"]}
    # each pass's counters less those after its server's pass before: 800 hit of 1,000 queried
    assert rates["distinct_1_cached"] == 0.0 and rates["prefix_1_cached"] == 0.8
    ratios = {(t["workload"], t["measure"]): t["ratio"] for t in got["targets"]}
    assert ratios == {
        ("prefix", "output_throughput"): 3.0,
        ("prefix", "ttft_p50"): 0.2,
        ("distinct", "output_throughput"): 0.995,
    }
    assert "| prefix_1_cached | cached | 10/10 |" in capsys.readouterr().out


def test_a_missed_target_fails(tmp_path):
    _write(tmp_path, 2000)
    assert prefix_report.main([str(tmp_path)]) == 1
    assert not json.loads((tmp_path / "summary.json").read_text())["ok"]
