"""GPU-busy share of a torch.profiler Chrome trace: the union of device activity (kernels, memcpy, memset;
overlapping streams counted once) against the window's wall time, the GPU-idle gaps (how many, how long,
the largest with the host operations running across them) and device time by kernel family and kernel.
Works on any torch.profiler trace (`prof.export_chrome_trace`), e.g. the one
`benchmarks/profile_engine.py --timeline` writes over a whole workload, or the worker's `--profile-dir` over a
serving run (the analysis itself is `runtime/common/gpu_timeline.py`).
    python -m benchmarks.gpu_timeline TRACE.json[.gz] [--wall-s S] [--top 10] [--json]"""

from __future__ import annotations

import argparse
import json

from runtime.common.gpu_timeline import load_trace, report, summarize


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--wall-s", type=float, default=None, help="the window's wall time (default: the trace's)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    s = summarize(load_trace(a.trace), None if a.wall_s is None else a.wall_s * 1e6, a.top)
    print(json.dumps(s, indent=1) if a.json else report(s))


if __name__ == "__main__":
    main()
