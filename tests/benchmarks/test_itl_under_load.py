"""The ITL-under-load comparison on hand-made bench_serving reports: only resident requests' ITLs count,
the percentile ratio and its tolerance, repeats pooled per side, warnings for runs that did not load
(or did), clear errors."""

from __future__ import annotations

import json

import pytest

from benchmarks import itl_under_load as itl
from tools.bench_report import percentiles


def record(adapter: str | None, gaps: list[float], error: str | None = None) -> dict:
    return {"adapter": adapter, "itl": gaps, "error": error}


def report(requests: list[dict], slot_loads: float | None, sha: str = "abc", label: str = "") -> dict:
    summary = {"num_requests": len(requests)}
    if slot_loads is not None:
        summary["slot_loads"] = slot_loads
    return {"tool": "bench_serving", "label": label, "workload": {"sha256": sha}, "summary": summary,
            "requests": requests}  # fmt: skip


RESIDENT = [0.010 + 0.001 * i for i in range(20)]  # P95 = 0.02805 (linear interpolation)


def test_pools_only_resident_requests_and_compares_p95():
    loads = report(
        [record("a", RESIDENT[:10]), record("b", RESIDENT[10:]), record("c", [9.0, 9.0])], slot_loads=3
    )
    slower = [x * 1.04 for x in RESIDENT]
    quiet = report([record("a", slower[:10]), record("b", slower[10:]), record("c", [0.001])], slot_loads=0)
    got = itl.compare(loads, quiet, {"a", "b"})
    assert got["loads"]["itl_samples"] == 20 and got["loads"]["requests"] == 2
    assert got["loads"]["itl"] == percentiles(RESIDENT)  # request "c" (9 s gaps) is not resident
    assert got["ratio"] == pytest.approx(1 / 1.04) and got["met"] and got["warnings"] == []
    worse = itl.compare(quiet, loads, {"a", "b"}, tolerance=0.03)  # 1.04 > 1.03
    assert worse["ratio"] == pytest.approx(1.04) and not worse["met"]
    assert itl.compare(quiet, loads, {"a", "b"}, tolerance=0.05)["met"]
    p50 = itl.compare(loads, quiet, {"a"}, stat="p50")
    assert p50["ratio"] == pytest.approx(1 / 1.04) and p50["adapters"] == ["a"]


def test_warns_when_the_runs_do_not_load_as_meant():
    quiet_by_mistake = report([record("a", RESIDENT)], slot_loads=0)
    loaded_by_mistake = report([record("a", RESIDENT), record("a", [0.01], error="boom")], slot_loads=2)
    got = itl.compare(quiet_by_mistake, loaded_by_mistake, ["a"])
    assert len(got["warnings"]) == 3 and got["quiet"]["failed"] == 1
    assert any("no adapter was copied" in w for w in got["warnings"])
    assert any("quiet1: 2 slot copies" in w for w in got["warnings"])
    no_metrics = itl.compare(
        report([record("a", RESIDENT)], None), report([record("a", RESIDENT)], None), ["a"]
    )
    assert sum("no server counters" in w for w in no_metrics["warnings"]) == 2


def test_clear_errors():
    ok = report([record("a", RESIDENT)], slot_loads=1)
    with pytest.raises(itl.ItlError, match="different workloads"):
        itl.compare(ok, report([record("a", RESIDENT)], 0, sha="other"), ["a"])
    assert itl.compare(ok, report([record("a", RESIDENT)], 0, sha="other"), ["a"], same_workload=False)
    with pytest.raises(itl.ItlError, match=r"no inter-token latencies .* adapters are \['a'\]"):
        itl.compare(ok, ok, ["zz"])
    with pytest.raises(itl.ItlError, match="not a bench_serving report"):
        itl.compare({"tool": "bench_peft", "requests": []}, ok, ["a"])
    with pytest.raises(itl.ItlError, match="stat"):
        itl.compare(ok, ok, ["a"], stat="p90")
    with pytest.raises(itl.ItlError, match="no resident adapters"):
        itl.compare(ok, ok, [])


def test_repeats_are_pooled_per_side():
    low, high = [0.01] * 10, [0.03] * 10
    got = itl.compare(
        [report([record("a", low)], 3), report([record("a", high)], 3)],
        [report([record("a", high)], 0), report([record("a", low)], 0)],
        ["a"],
        stat="p50",
    )
    assert got["loads"]["itl_samples"] == 20 and got["loads"]["slot_loads"] == 6
    assert got["loads"]["itl"] == percentiles(low + high) and got["ratio"] == pytest.approx(1.0)
    assert [r["file"] for r in got["loads"]["runs"]] == ["loads1", "loads2"]
    assert "samples" not in got["loads"]["runs"][0]  # the JSON keeps summaries, not every sample
    assert "**with loads (pooled)**" in itl.format_markdown(got)
    with pytest.raises(itl.ItlError, match="at least one"):
        itl.compare([], [report([record("a", low)], 0)], ["a"])


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    a, b, out = tmp_path / "loads.json", tmp_path / "quiet.json", tmp_path / "cmp.json"
    a.write_text(json.dumps(report([record("a", RESIDENT)], 4, label="with loads")))
    b.write_text(json.dumps(report([record("a", RESIDENT)], 0, label="resident")))
    got = itl.main(["--loads", str(a), "--quiet", str(b), "--adapters", "a", "--out", str(out)])
    text = capsys.readouterr().out
    assert "| with loads | 1 | 20 | 4 | 19.50 | 19.50 |" in text and "1.000 (target ≤ 1.05: met)" in text
    assert "pooled" not in text  # one run a side: no pooled rows
    assert json.loads(out.read_text()) == got and got["met"]
    with pytest.raises(SystemExit):
        itl.main(["--loads", str(a), "--quiet", str(tmp_path / "missing.json"), "--adapters", "a"])
    assert "missing.json" in capsys.readouterr().err
