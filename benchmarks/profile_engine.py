"""Profiles the engine without the process pipeline: the offline `LLM` (same planner, executor and model
runner as `lorapipe serve`) runs a workload file's requests all at once under cProfile. Prints output
tokens/s, host seconds per step phase and the functions with the most own time. `--timeline TRACE` runs
the workload under torch.profiler instead (device activity; `--timeline-host` adds host operations, at
a cost to host speed) and reports the GPU-busy share of the run's wall time (benchmarks/gpu_timeline.py).
    python -m benchmarks.profile_engine --model DIR --adapter-dir DIR --workload FILE [--max-running 256]"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import time
from pathlib import Path

from proto.sampling import SamplingParams
from runtime.offline import LLM
from tools.workload import read_workload


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument(
        "--adapter-dir", required=True, help="a folder of adapter folders, named as in the workload"
    )
    p.add_argument("--workload", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--slots", type=int, default=32, help="distinct adapters per step (--max-loras-per-batch)")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cuda-graph-max-batch", type=int, default=None)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", help="JSON summary")
    p.add_argument(
        "--timeline", metavar="TRACE", help="torch.profiler Chrome trace of the run (.json or .json.gz)"
    )
    p.add_argument("--timeline-host", action="store_true", help="record host operations in the trace too")
    a = p.parse_args(argv)
    work = read_workload(a.workload)
    names = sorted({w.adapter for w in work if w.adapter is not None})
    llm = LLM(
        a.model, adapters={n: Path(a.adapter_dir) / n for n in names}, device=a.device, dtype=a.dtype,
        max_loras_per_batch=a.slots, max_lora_rank=a.max_lora_rank, max_running_requests=a.max_running,
        max_model_len=a.max_model_len, cuda_graph_max_batch=a.cuda_graph_max_batch,
    )  # fmt: skip
    prompts = [w.prompt_value() for w in work]
    adapters = [w.adapter for w in work]
    sampling = [SamplingParams(max_tokens=w.max_tokens, ignore_eos=True) for w in work]
    llm.generate(prompts[:8], adapters=adapters[:8], sampling=sampling[:8])  # warm-up
    if a.timeline:
        outs, took, text = _timeline(llm, prompts, adapters, sampling, a)
    else:
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        outs = llm.generate(prompts, adapters=adapters, sampling=sampling)
        prof.disable()
        took = time.perf_counter() - start
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(a.top)
    n_out = sum(len(o.token_ids) for o in outs)
    stats = llm.last_stats
    graphs = llm.runner.graphs
    summary = {
        "requests": len(work),
        "seconds": took,
        "output_tokens": n_out,
        "output_tok_per_s": n_out / took,
        "steps": stats.steps,
        "graph_replays": graphs.replays if graphs is not None else 0,
        "phase_seconds": llm.last_phase_seconds,
    }
    print(json.dumps(summary, indent=1))
    print(text.getvalue())
    if a.out:
        Path(a.out).write_text(json.dumps({**summary, "profile": text.getvalue()}, indent=1))


def _timeline(llm: LLM, prompts, adapters, sampling, a) -> tuple[list, float, io.StringIO]:
    """The run under torch.profiler: its outputs, wall seconds and the GPU-busy report."""
    import torch

    from runtime.common.gpu_timeline import load_trace, report, summarize

    cuda = a.device.startswith("cuda")
    acts = [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    if a.timeline_host or not cuda:
        acts.append(torch.profiler.ProfilerActivity.CPU)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.profiler.profile(activities=acts) as prof:
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, adapters=adapters, sampling=sampling)
        sync()
        took = time.perf_counter() - start
    path = Path(a.timeline)
    plain = path.with_suffix("") if path.suffix == ".gz" else path
    prof.export_chrome_trace(str(plain))
    if plain != path:
        path.write_bytes(gzip.compress(plain.read_bytes()))
        plain.unlink()
    text = io.StringIO()
    text.write(report(summarize(load_trace(path), wall_us=took * 1e6, top=a.top)) + "\n")
    return outs, took, text


if __name__ == "__main__":
    main()
