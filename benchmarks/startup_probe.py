"""Where a server's start-up seconds go before its worker builds the model, each part timed in a fresh
interpreter (median of --reps): the launcher's path to spawning the stages (imports, every check with
the --adapter directories, the four stage configs; whether it imported torch), the CUDA driver's
initialisation as the launcher asks it (`runtime/common/cuda_driver.py`), `import torch`, `import
triton` after it, the worker's imports, the CUDA context torch creates, and the page-locking of a host
cache of --host-cache-gb. On the GPU machine (--device cuda) these are the numbers the CPU cannot show.
One markdown table on stdout, everything in OUT/startup_probe.json.
    python -m benchmarks.startup_probe OUT --model DIR [--adapters DIR --num-adapters N] [--device cuda]
        [--serve-args "--quantization fp8 --dtype bfloat16 --tensor-parallel-size 2"]"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each snippet prints one JSON object; "s" is the seconds it timed (after the interpreter started).
_LAUNCH = """
import json, shutil, sys, time
t = time.perf_counter()
from runtime.base.endpoints import Endpoints, make_run_dir
from runtime.host_cache_size import host_cache_bytes
from runtime.serve_checks import parse_serve_args, validate
from runtime.stage_configs import stage_configs
import runtime.launcher
args = parse_serve_args(sys.argv[1:])
model_cfg = validate(args)
run_dir = make_run_dir()
endpoints = Endpoints.in_run_dir(run_dir, client=args.endpoint)
stage_configs(args, model_cfg, endpoints, "p", host_cache_bytes(args, model_cfg))
s = time.perf_counter() - t
shutil.rmtree(run_dir)
print(json.dumps({"s": s, "torch_imported": "torch" in sys.modules}))
"""
_CUDA_PROBE = """
import json, time
from runtime.common.cuda_driver import cuda_device_count
t = time.perf_counter()
n = cuda_device_count()
print(json.dumps({"s": time.perf_counter() - t, "devices": n}))
"""
_TORCH = """
import json, time
t = time.perf_counter()
import torch
s = time.perf_counter() - t
t = time.perf_counter()
import triton
print(json.dumps({"s": s, "triton_after_torch_s": time.perf_counter() - t}))
"""
_WORKER = """
import json, time
t = time.perf_counter()
import stages.worker.actor, stages.worker.config
print(json.dumps({"s": time.perf_counter() - t}))
"""
_PIN = """
import json, sys, time
from multiprocessing.shared_memory import SharedMemory
import torch
from runtime.common.host_pool import register_pinned, unregister_pinned
torch.zeros(1, device="cuda")
shm = SharedMemory(create=True, size=int(float(sys.argv[1]) * 2**30))
try:
    t = time.perf_counter()
    register_pinned(shm)
    s = time.perf_counter() - t
    unregister_pinned(shm)
finally:
    shm.close()
    shm.unlink()
print(json.dumps({"s": s, "gib": float(sys.argv[1])}))
"""
_CONTEXT = """
import json, time
import torch
t = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
print(json.dumps({"s": time.perf_counter() - t}))
"""


def _run(code: str, argv: Sequence[str] = ()) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"probe failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe(serve_argv: Sequence[str], cuda: bool, reps: int, pin_gib: float = 4.0) -> dict[str, dict]:
    """Every part `reps` times, alternating; per part the median seconds and the last run's extras."""
    parts = {
        "launcher to spawn": (_LAUNCH, serve_argv),
        "import torch": (_TORCH, ()),
        "worker imports": (_WORKER, ()),
    }
    if cuda:
        parts |= {"CUDA driver init (launcher)": (_CUDA_PROBE, ()), "CUDA context (torch)": (_CONTEXT, ())}
        parts |= {"pin the host cache (worker)": (_PIN, (str(pin_gib),))}
    runs: dict[str, list[dict]] = {name: [] for name in parts}
    for _ in range(reps):
        for name, (code, argv) in parts.items():
            runs[name].append(_run(code, argv))
    out = {}
    for name, rs in runs.items():
        row = {k: v for k, v in rs[-1].items() if k != "s"}
        row["median_s"] = statistics.median(r["s"] for r in rs)
        row["runs_s"] = [round(r["s"], 4) for r in rs]
        if "triton_after_torch_s" in rs[-1]:
            row["triton_after_torch_s"] = statistics.median(r["triton_after_torch_s"] for r in rs)
        out[name] = row
    return out


def table(result: dict[str, dict]) -> str:
    lines = ["| part | median s | runs s | notes |", "|---|---|---|---|"]
    for name, row in result.items():
        notes = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                          if k not in ("median_s", "runs_s"))  # fmt: skip
        runs = " ".join(f"{s:.3f}" for s in row["runs_s"])
        lines.append(f"| {name} | {row['median_s']:.3f} | {runs} | {notes or '-'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="results directory")
    p.add_argument("--model", required=True, help="the model directory a server would get")
    p.add_argument("--adapters", type=Path, default=None, help="a directory of adapter0..adapterN-1")
    p.add_argument("--num-adapters", type=int, default=0, help="how many of them to give as --adapter")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--host-cache-gb", type=float, default=4.0, help="the host cache the worker pins")
    p.add_argument("--serve-args", default="", help="more `serve` flags for the launcher, one quoted string")
    ns = p.parse_args(argv)
    serve = ["--model", ns.model, "--device", ns.device, "--max-lora-rank", str(ns.max_lora_rank)]
    serve += ["--endpoint", "tcp://127.0.0.1:0", "--metrics-port", "-1", "--port", "0"]
    serve += shlex.split(ns.serve_args)
    for i in range(ns.num_adapters):
        serve += ["--adapter", f"adapter{i}={ns.adapters / f'adapter{i}'}"]
    result = probe(serve, ns.device == "cuda", ns.reps, ns.host_cache_gb)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "startup_probe.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
