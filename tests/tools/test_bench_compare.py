"""bench_compare: candidate/baseline ratios of summary metrics with optional bounds, the same-workload
check and clear errors for unknown metrics or specs."""

from __future__ import annotations

import json

import pytest

from tools import bench_compare as bc


def report(ttft_p50: float, tput: float, sha: str = "s", failed: int = 0) -> dict:
    summary = {"ttft": {"p50": ttft_p50}, "output_throughput": tput, "failed": failed}
    return {"label": f"t{ttft_p50}", "workload": {"sha256": sha}, "summary": summary}


def test_ratios_and_bounds():
    got = bc.compare(report(0.5, 90.0), report(1.0, 100.0), ["ttft.p50<=0.6", "output_throughput>=0.95"])
    ttft, tput = got["rows"]
    assert ttft["ratio"] == pytest.approx(0.5) and ttft["met"] and ttft["bound"] == "<= 0.6"
    assert tput["ratio"] == pytest.approx(0.9) and tput["met"] is False and not got["met"]
    free = bc.compare(report(0.5, 90.0), report(1.0, 100.0), ["ttft.p50", "output_throughput"])
    assert [r["met"] for r in free["rows"]] == [None, None] and free["met"]
    table = bc.format_markdown(got)
    assert "| ttft.p50 | 500.0 ms | 1000.0 ms | 0.500 | ≤ 0.6 | yes |" in table
    assert "| output_throughput | 90 | 100 | 0.900 | ≥ 0.95 | **no** |" in table
    assert bc.compare(report(1, 1, failed=2), report(1, 1), ["ttft.p50"])["warnings"] == [
        "candidate: 2 requests failed"
    ]


def test_errors(tmp_path, capsys):
    a, b = report(0.5, 90.0), report(1.0, 100.0, sha="other")
    with pytest.raises(bc.CompareError, match="different workloads"):
        bc.compare(a, b, ["ttft.p50"])
    assert bc.compare(a, b, ["ttft.p50"], same_workload=False)["rows"][0]["ratio"] == 0.5
    with pytest.raises(bc.CompareError, match="no summary value 'e2e.p50'"):
        bc.compare(a, a, ["e2e.p50"])
    with pytest.raises(bc.CompareError, match="expected KEY"):
        bc.compare(a, a, ["ttft.p50 < 3"])
    with pytest.raises(bc.CompareError, match="not a number"):
        bc.compare(a, a, ["ttft"])
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(report(1.0, 100.0)))
    out = tmp_path / "c.json"
    got = bc.main([str(fa), str(fb), "--metric", "ttft.p50<=0.6", "--out", str(out)])
    assert json.loads(out.read_text()) == got and got["met"]
    with pytest.raises(SystemExit):
        bc.main([str(fa), str(fb)])
    assert "no --metric" in capsys.readouterr().err
