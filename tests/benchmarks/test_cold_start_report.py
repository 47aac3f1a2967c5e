"""The cold-start report reads the warm-up's own log lines, the ready times and the bursts, and judges
the targets."""

from __future__ import annotations

import json

from benchmarks.cold_start_report import build, table
from stages.worker.warmup import done_line


def _burst(path, tok_s: float) -> None:
    path.write_text(json.dumps({"summary": {"output_throughput": tok_s}}))


def test_report_reads_logs_and_judges_targets(tmp_path):
    (tmp_path / "ready.txt").write_text(
        "mixed_cold=24.5\nr16_cold=21.0\nwarmup_cli_s=40\nmixed_prebuilt=12.0\nweights_read_s=3.50\n"
    )
    (tmp_path / "server_mixed_cold.log").write_text(
        "warm-up: 110 LoRA and 15 attention kernel variants to compile or load (cache: x); axes\n"
        f"{done_line(11.26, 300, 300, 6, 420)}\ncaptured 33 decode CUDA graphs in 2.5 s\n"
        "captured 9 full step CUDA graphs (0 layer-gated; token buckets 128,256) in 1.5 s\n"
    )
    (tmp_path / "server_mixed_prebuilt.log").write_text(  # the cache held every kernel: no pool
        "2026-01-01 00:00:00,100 launcher INFO stages spawned 0.41 s after launch\n"
        f"{done_line(2.0, 0, 0, 0, 420, 1.3)}\n"
        "2026-01-01 00:00:05,000 worker INFO host cache pinned (4096 MiB) in 1.3 s\n"
        "2026-01-01 00:00:06,000 worker INFO start-up: process 3.1 s before the model runner; weights 0.4 s\n"
        "2026-01-01 00:00:06,100 launcher INFO stage 'worker' ready (pid 7) 6.52 s after launch\n"
    )
    _burst(tmp_path / "mixed_first.json", 30000.0)
    _burst(tmp_path / "mixed_second.json", 31000.0)
    r = build(tmp_path, 0.95)
    a = r["servers"]["mixed_cold"]
    assert (a["variants"], a["warmup_s"], a["kernels"], a["pool_compiled"], a["worker_compiled"]) == (
        125,
        11.3,
        300,
        300,
        6,
    )
    assert a["graph_capture_s"] == 4.0 and abs(a["ratio"] - 30000 / 31000) < 1e-9
    c = r["servers"]["mixed_prebuilt"]
    assert (c["kernels"], c["pool_compiled"], c["worker_compiled"]) == (420, 0, 0)
    assert (c["spawned_s"], c["worker_ready_s"]) == (0.41, 6.52) and a["spawned_s"] is None
    assert c["startup"] == "process 3.1 s before the model runner; weights 0.4 s"
    assert c["host_cache_pinned_s"] == 1.3 and a["host_cache_pinned_s"] is None
    assert c["cache_read_s"] == 1.3 and a["cache_read_s"] is None
    verdict = {c["target"]: c["pass"] for c in r["checks"]}
    assert verdict == {
        "a: ready <= 30 s": True,
        "b: ready <= 20 s": False,
        "c: ready - weight read <= 10 s": True,
        "c: nothing compiled at start": True,
        "mixed_cold: first/second burst >= 0.95": True,
    }
    assert "FAIL b: ready <= 20 s" in table(r)
    assert "stages spawned at 0.41 s, worker ready at 6.52 s" in table(r)


def test_timeline_puts_every_second_to_ready_in_order(tmp_path):
    (tmp_path / "ready.txt").write_text("mixed_prebuilt=14.20\nweights_read_s=0.40\n")
    (tmp_path / "server_mixed_prebuilt.log").write_text(
        "t launcher INFO stages spawned 0.96 s after launch (interpreter, imports, argument checks 0.80 s, "
        "spawning 0.16 s)\n"
        "t worker INFO start-up: process started 0.90 s after launch, 3.80 s before the model runner "
        "(0.50 s of it waiting for its config); "
        "runner init 0.50 s, weights 0.40 s, warm-up 1.80 s, graph capture 4.20 s, "
        "rest of the runner 0.00 s; after the runner: host cache pinning 0.00 s, executor 0.10 s, "
        "rest of setup 0.00 s, announce 0.30 s; "
        "WorkerStarted sent 12.10 s after launch; warm-up parts (plan 0.1 s, launch 1.7 s); 0 kernels "
        "compiled during graph capture\n"
        "t launcher INFO stage 'worker' ready (pid 7) 12.11 s after launch\n"
        "t launcher INFO stage 'scheduler' ready (pid 8) 13.90 s after launch\n"
    )
    row = build(tmp_path, 0.95)["servers"]["mixed_prebuilt"]
    parts = dict(row["timeline"])
    first = "launch to the worker's process (launcher: interpreter, imports, argument checks 0.80 s"
    assert list(parts)[0].startswith(first) and parts[list(parts)[0]] == 0.90
    assert abs(parts["worker: imports and actor"] - 3.30) < 1e-9 and parts["worker: graph capture"] == 4.20
    assert parts["worker: waiting for the launcher's config"] == 0.50
    assert parts["worker: announce"] == 0.30 and parts["worker: executor"] == 0.10
    # 0.90 + 3.80 + 0.50 + 0.40 + 1.80 + 4.20 + 0.10 + 0.30 = 12.00 of the 12.10 s at WorkerStarted
    assert abs(parts["unattributed"] - 0.10) < 1e-9
    assert abs(parts["scheduler's Ready after WorkerStarted (planner; the loader if later)"] - 1.80) < 1e-9
    assert abs(parts["health seen ok by the client after the scheduler's Ready"] - 0.30) < 1e-9
    assert abs(sum(parts.values()) - 14.20) < 1e-9
    text = table(build(tmp_path, 0.95))
    assert "Where c. as a, on a `lorapipe warmup` cache's 14.20 s to ready went:" in text
    assert "| worker: graph capture | 4.20 |" in text and "| unattributed | 0.10 |" in text
