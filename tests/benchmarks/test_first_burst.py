"""The first-burst benchmark's pieces: the summary (ratio, targets, what it reads from server logs) and
the readiness wait's refusals (nothing listening, the server process gone)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from benchmarks import first_burst_report as fbr
from tools.wait_ready import wait_ready


def _bench(path, tput: float, ttft: float) -> str:
    s = {"output_throughput": tput, "ttft": {"p50": ttft, "p95": 2 * ttft}, "completed": 10, "failed": 0}
    s["adapter_loads"] = 32 if tput < 15500 else 0
    path.write_text(json.dumps({"summary": {**s, "duration_s": 1.0}}))
    return str(path)


def test_report_ratio_targets_and_log_values(tmp_path, capsys):
    cold = tmp_path / "cold.log"
    cold.write_text(
        "2026-11-23 10:00:00,000 worker INFO warm-up: 126 LoRA and 12 attention kernel variants to compile "
        "or load (cache: /x)\n... warm-up done in 95.5 s\n... captured 46 decode CUDA graphs in 12.3 s\n"
    )
    argv = [
        "--cold-ready",
        "140",
        "--warm-ready",
        "24.5",
        "--cold-log",
        str(cold),
        "--out",
        str(tmp_path / "r.json"),
    ]
    argv += ["--run", f"first burst={_bench(tmp_path / 'a.json', 15000.0, 3.1)}"]
    argv += ["--run", f"second burst={_bench(tmp_path / 'b.json', 16000.0, 3.0)}"]
    assert fbr.main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["targets"]["first_over_second_throughput"]["value"] == 15000 / 16000
    assert result["targets"]["first_over_second_throughput"]["pass"] is True
    assert result["targets"]["warm_cache_ready_s"]["pass"] is True
    assert result["starts"]["cold"]["warmup_s"] == 95.5 and result["starts"]["cold"]["graphs"] == 46
    assert "| cold compile cache | 140.0 | 95.5 | 126 + 12 | 46 (12.3) |" in out
    assert "| warm compile cache | 24.5 | - | - | - |" in out
    assert "- first_over_second_throughput: 0.938 (target >= 0.9): PASS" in out
    assert "| first burst | 15000.0 | 3.10 / 6.20 | 10 / 0 | 1.0 | 32 |" in out
    fbr.main([*argv[:2], "--warm-ready", "31", "--run", argv[-3], "--run", argv[-1]])
    assert "- warm_cache_ready_s: 31.000 (target <= 30.0): FAIL" in capsys.readouterr().out


def test_wait_ready_gives_up_on_a_dead_server_or_the_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    start = time.monotonic()
    assert not wait_ready(addr, deadline_s=1.0)
    assert time.monotonic() - start < 8
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    start = time.monotonic()
    assert not wait_ready(addr, deadline_s=60.0, pid=gone.pid)
    assert time.monotonic() - start < 1
