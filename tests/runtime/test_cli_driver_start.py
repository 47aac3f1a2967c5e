"""`lorapipe serve` and `lorapipe warmup` start the CUDA driver's initialisation on a thread before they
import and parse their arguments (the checks that ask it then find it done), and not with `--device cpu`.
The driver's initialisation is stood in for by one that notes when and where it ran (this machine may
have no driver); each run is a fresh interpreter, as the command is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_RUN = """
import json, sys, threading
from runtime.common import cuda_driver
seen = []
def driver():
    seen.append([threading.current_thread().name, "runtime.serve_args" in sys.modules])
cuda_driver._driver = driver
from runtime.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
for t in threading.enumerate():
    if t.name == "cuda-driver":
        t.join()
print(json.dumps({"seen": seen, "code": code}))
"""


def _run(*argv: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _RUN, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_driver_starts_on_a_thread_before_the_arguments_are_read(tmp_path):
    missing = str(tmp_path / "no-model")
    for command in ("serve", "warmup"):
        out = _run(command, "--model", missing)
        assert out["code"] == 2  # the missing model, refused as before
        assert out["seen"][0] == ["cuda-driver", False], out
    for cpu in (["--device", "cpu"], ["--device=cpu"]):
        out = _run("serve", "--model", missing, *cpu)
        assert out == {"seen": [], "code": 2}, out
