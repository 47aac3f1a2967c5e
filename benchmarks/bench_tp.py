"""Generation throughput of the offline engine at one tensor-parallel size, base-only and with adapters,
on a batch small enough that decode reads weights more than it computes.

python -m benchmarks.bench_tp MODEL --tp 2 --adapters A_DIR [B_DIR ...] --batch 16 64 --prompt-len 128 \
    --output-len 256 --rounds 2 --out tp2.json [--disable-custom-all-reduce]

For each batch size, after one warm-up batch of each kind, the rounds run base-only and adapter batches
A-B-B-A (the adapters assigned round-robin, every one in every step); each batch's output tokens per
second and the medians go to --out (JSON) and stdout. The LoRA overhead is base tok/s over adapter tok/s,
less one. `close_s` is how long `LLM.close()` took, and `rank_exit_codes` how the other ranks ended."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from proto.sampling import SamplingParams
from runtime.offline import LLM


def _batch(llm: LLM, prompts, adapters, output_len: int) -> tuple[float, list[list[int]]]:
    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, adapters=adapters, sampling=sampling)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    if tokens != len(prompts) * output_len or any(o.error for o in outs):
        raise RuntimeError(f"expected {len(prompts) * output_len} tokens, got {tokens}")
    return tokens / seconds, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--adapters", nargs="*", default=[])
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--disable-custom-all-reduce", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    names = {Path(p).name: p for p in a.adapters}
    start = time.perf_counter()
    llm = LLM(
        a.model,
        adapters=names,
        device="cuda",
        max_lora_rank=a.max_lora_rank,
        max_running_requests=max(*a.batch, 16),
        tensor_parallel_size=a.tp,
        disable_custom_all_reduce=a.disable_custom_all_reduce,
    )
    built = time.perf_counter() - start
    batches, greedy = {}, {}
    for batch in a.batch:
        runs, tokens = _rounds(llm, a, names, batch)
        batches[str(batch)] = runs
        greedy = greedy or tokens
    replays = llm.runner.graphs.replays if llm.runner.graphs is not None else 0
    procs = list(llm.ranks.procs) if llm.ranks is not None else []
    start = time.perf_counter()
    llm.close()
    closed = time.perf_counter() - start
    result = {
        "tp": a.tp,
        "custom_all_reduce": not a.disable_custom_all_reduce,
        "prompt_len": a.prompt_len,
        "output_len": a.output_len,
        "adapters": len(names),
        "build_s": round(built, 1),
        "close_s": round(closed, 2),
        "rank_exit_codes": [p.returncode for p in procs],
        "decode_graph_replays": replays,
        "batches": batches,
        "greedy_tokens": greedy,  # each kind's first batch, compared by benchmarks/compare_greedy
    }
    print(json.dumps({k: v for k, v in result.items() if k != "greedy_tokens"}))
    if a.out is not None:
        a.out.write_text(json.dumps(result, indent=1))


def _rounds(llm: LLM, a, names: dict, batch: int) -> tuple[dict, dict]:
    """One batch size's A-B-B-A rounds: {tok_s, median_tok_s, lora_overhead}, and the first batch's
    greedy tokens of each kind."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 30000, (a.prompt_len,), generator=g).tolist() for _ in range(batch)]
    mix = [list(names)[i % len(names)] for i in range(batch)] if names else None
    runs: dict[str, list[float]] = {"base": [], "lora": []}
    order = ["base", "lora"] + (["base", "lora", "lora", "base"] * a.rounds if mix else ["base"] * a.rounds)
    greedy: dict[str, list[list[int]]] = {}
    for i, kind in enumerate(order):
        rate, tokens = _batch(llm, prompts, mix if kind == "lora" else None, a.output_len)
        greedy.setdefault(kind, tokens)
        if i >= (2 if mix else 1):  # the first of each kind is the warm-up
            runs[kind].append(rate)
    out: dict = {"tok_s": runs, "median_tok_s": {k: statistics.median(v) for k, v in runs.items() if v}}
    if runs["lora"]:
        m = out["median_tok_s"]
        out["lora_overhead"] = m["base"] / m["lora"] - 1
    return out, greedy


if __name__ == "__main__":
    main()
