"""The demo's closing lines: one line of what the server counted (labelled series filtered by label, so a
failed load is not counted as a read), and the `serve` command for the demo's own files. A demo run on
files an earlier run made imports no torch before it spawns the server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, generate_latest

from runtime.demo import ensure_demo_files, summarize

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "triton", "safetensors", "transformers")  # as test_launch_imports.py

_ENSURE = """
import sys
from pathlib import Path
from runtime.demo import ensure_demo_files
model, adapters = ensure_demo_files(Path(sys.argv[1]))
print(repr((str(model), {name: str(path) for name, path in adapters.items()})))
print([m for m in HEAVY if m in sys.modules])
"""


def test_the_summary_is_one_line_of_counts():
    reg = CollectorRegistry()
    Counter("lorapipe_plans", "plans", ["stage"], registry=reg).labels(stage="scheduler").inc(25)
    loads = Counter("lorapipe_adapter_loads", "by result", ["stage", "result"], registry=reg)
    loads.labels(stage="loader", result="staged").inc(3)
    loads.labels(stage="loader", result="failed").inc(1)
    Counter("lorapipe_gc_pauses", "noise", ["stage"], registry=reg).labels(stage="worker").inc(9)
    text = summarize(generate_latest(reg).decode())
    assert text == "25 steps, 3 adapter reads from disk, 0 copies into the adapter pool"


def test_a_second_demo_run_imports_no_torch(tmp_path):
    model, adapters = ensure_demo_files(tmp_path)  # the first run makes them (with torch)
    code = f"HEAVY = {HEAVY!r}\n" + _ENSURE
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    found, heavy = res.stdout.strip().splitlines()[-2:]
    assert found == repr((str(model), {name: str(path) for name, path in adapters.items()}))
    assert heavy == "[]", heavy
    assert all((Path(p) / "adapter_config.json").is_file() for p in adapters.values())
