"""Decode throughput of the offline engine (the server's planner, executor and runner in one process)
with and without per-request sampling features, on one model and its adapters: `plain` (nobody asks for
anything), `logprobs5` (top_logprobs=5 on every request), `guided` (a JSON schema on every request, long
enough that every output runs to --output-len, so the runs decode the same tokens) and `guided_check`
(a bounded schema, every output must end inside its budget and validate). Each variant runs a warm-up
batch and then the measured one; the engine is built once. Only `plain` uses no API a tree without these
features lacks, so an older checkout can run it for an A-B comparison:

    python benchmarks/bench_sampling_features.py --model DIR --adapter-dir DIR --variants plain,... OUT.json

Prints one line per variant and writes OUT.json: per variant its throughput, steps, milliseconds a step
and the executor's host seconds per phase. `--profile` runs each variant twice more and adds where its
time goes: `timeline`, the GPU-busy share, idle gaps and kernels of a torch.profiler run
(runtime/common/gpu_timeline.py; on CUDA), and `cprofile`, the host functions with the most own time."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

LONG_SCHEMA = {  # 100 strings at least: the output reaches any --output-len up to a few hundred tokens
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 100}},
    "required": ["items"],
}
CHECK_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["answer", "count", "ok", "tags"],
    "additionalProperties": False,
}


def sampling_of(variant: str, output_len: int):
    from proto.sampling import SamplingParams

    if variant == "plain":
        return SamplingParams(max_tokens=output_len, ignore_eos=True)
    if variant == "logprobs5":
        return SamplingParams(max_tokens=output_len, ignore_eos=True, logprobs=5)
    from proto.sampling import Guided

    if variant == "guided":
        return SamplingParams(max_tokens=output_len, guided=Guided("json", json.dumps(LONG_SCHEMA)))
    if variant == "guided_check":
        return SamplingParams(max_tokens=512, guided=Guided("json", json.dumps(CHECK_SCHEMA)))
    raise ValueError(f"unknown variant {variant!r}")


def run(llm, variant: str, prompts, adapters, output_len: int) -> dict:
    params = sampling_of(variant, output_len)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, adapters, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    row = {"variant": variant, "seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds}
    steps = llm.last_stats.steps if llm.last_stats is not None else 0
    row["steps"], row["ms_per_step"] = steps, 1e3 * seconds / max(1, steps)
    row["phase_seconds"] = {k: round(v, 4) for k, v in llm.last_phase_seconds.items()}
    row["errors"] = sum(o.finish_reason == "error" for o in outs)
    if variant == "guided_check":
        import jsonschema

        valid = 0
        for o in outs:
            try:
                jsonschema.validate(json.loads(o.text), CHECK_SCHEMA)
                valid += o.finish_reason == "stop"
            except (ValueError, jsonschema.ValidationError):
                pass
        row["valid"], row["requests"] = valid, len(outs)
    if variant == "logprobs5":
        row["with_logprobs"] = sum(
            o.logprobs is not None and len(o.logprobs) == len(o.token_ids) for o in outs
        )
    return row


def profiled(llm, variant: str, prompts, adapters, output_len: int, out_dir: Path) -> dict:
    """Where one run of `variant` spends its time: a torch.profiler run's GPU timeline summary (CUDA
    only; the trace is written under `out_dir` and removed once summarized) and a cProfile run's top
    host functions by own time."""
    import cProfile
    import io
    import pstats

    import torch

    found: dict = {}
    if torch.cuda.is_available() and llm.runner.device.type == "cuda":
        from runtime.common.gpu_timeline import load_trace, summarize

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(llm, variant, prompts, adapters, output_len)
            torch.cuda.synchronize()
            wall_us = 1e6 * (time.perf_counter() - t0)
        trace = out_dir / f"trace_{variant}.json"
        prof.export_chrome_trace(str(trace))
        summary = summarize(load_trace(trace), wall_us=wall_us, top=8)
        trace.unlink()
        found["timeline"] = summary  # its gaps name no host operations: only the device is recorded
    prof = cProfile.Profile()
    prof.enable()
    run(llm, variant, prompts, adapters, output_len)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    found["cprofile"] = text.getvalue()[-12000:]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter-dir", required=True, help="holds adapter0 .. adapterN-1")
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--variants", default="plain,logprobs5,guided,guided_check,plain")
    ap.add_argument("--label", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="add each variant's timeline and host profile")
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    from runtime.offline import LLM

    names = [f"adapter{i}" for i in range(a.num_adapters)]
    positions = json.loads((Path(a.model) / "config.json").read_text())["max_position_embeddings"]
    llm = LLM(
        a.model, adapters={n: Path(a.adapter_dir) / n for n in names}, device=a.device, dtype=a.dtype,
        max_loras_per_batch=a.num_adapters, max_lora_rank=16, max_running_requests=a.num_prompts,
        max_model_len=min(2048, positions),
        prefix_caching=False,  # the variants repeat the prompts: each must prefill them
    )  # fmt: skip
    rng = random.Random(0)
    vocab = min(llm.tokenizer.get_vocab_size(), llm.runner.model_cfg.vocab_size)
    prompts = [[rng.randrange(2, vocab) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    adapters = [names[i % len(names)] for i in range(a.num_prompts)]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant in a.variants.split(","):
        run(llm, variant, prompts[:32], adapters[:32], a.output_len)  # warm-up: grammars, allocations
        row = run(llm, variant, prompts, adapters, a.output_len)
        row["label"] = a.label
        if a.profile:
            row |= profiled(llm, variant, prompts, adapters, a.output_len, a.out.parent)
        rows.append(row)
        extra = {k: row[k] for k in ("valid", "requests", "with_logprobs", "errors") if k in row}
        print(
            f"{a.label:<4} {variant:<13} {row['tok_s']:>10.0f} tok/s  {row['seconds']:>7.2f} s  "
            f"{row['ms_per_step']:>6.2f} ms/step  {row['phase_seconds']}  {extra}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
