"""bench_loader on the CPU with the tiny model (rates mean little here), run as its command line (it tunes
its own process as the loader does): the report has a row per rank with positive plain-read and load
rates, single and parallel, the packed blocks verified against `read_adapter`, targets judged only from
their size, the table printed, and bad arguments refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_loader

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("writers", [0, 2])
def test_tiny_run_report_and_table(tiny_llama, tmp_path, writers):
    """With the threads writing and with part-writer processes: every block equals the in-process reader's."""
    out = tmp_path / "loader.json"
    args = ["--model", str(tiny_llama), "--ranks", "2,5", "--reps", "2", "--threads", "2", "--parallel", "3"]
    args += ["--writers", str(writers)]
    args += [
        "--segment-mb",
        "0.01",
        "--read-mb",
        "0.001",
        "--cold",
        "--target-min-mb",
        "0.01",
        "--work-dir",
        str(tmp_path),
    ]
    cmd = [sys.executable, "-m", "benchmarks.bench_loader", *args, "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100, check=True)
    report = json.loads(out.read_text())
    assert report["tool"] == "bench_loader" and report["model"]["layers"] == 2
    rows = report["rows"]
    assert [r["rank"] for r in rows] == [2, 5]
    for r in rows:
        assert r["verified"] is True
        assert r["file_bytes"] > r["packed_bytes"] > 0  # float32 files, bfloat16 blocks
        for key in (
            "plain",
            "load",
            "load_file",
            "plain_parallel",
            "load_parallel",
            "load_cold",
            "plain_cold",
        ):
            assert r[f"{key}_gbps"] > 0, key
        assert len(r["load_s"]) == len(r["load_parallel_s"]) == 2
        assert set(r["met"]) == {"single", "parallel"}
    assert rows[0]["met"]["single"] is None  # 2.2 kB packed: below --target-min-mb
    assert isinstance(rows[1]["met"]["single"], bool)
    table = run.stdout
    assert "| 2 |" in table and "| 5 |" in table and "3 loads (aggregate)" in table
    assert not list(tmp_path.glob("bench_loader-*"))  # generated adapters are removed


@pytest.mark.parametrize("bad", [["--reps", "0"], ["--ranks", "0"], ["--read-mb", "0"], ["--model", "/nope"]])
def test_bad_arguments(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bench_loader.main(bad)
    assert e.value.code == 2
