"""Generation throughput of the offline engine at one tensor-parallel size, base-only and with adapters,
on a batch small enough that decode reads weights more than it computes.

python -m benchmarks.bench_tp MODEL --tp 2 --adapters A_DIR [B_DIR ...] --batch 16 64 --prompt-len 128 \
    --output-len 256 --rounds 2 --out tp2.json [--disable-custom-all-reduce] [--device cpu --dtype float32]

For each batch size, after one warm-up batch of each kind, the rounds run base-only and adapter batches
A-B-B-A (the adapters assigned round-robin, every one in every step); each batch's output tokens per
second and the medians go to --out (JSON) and stdout. The LoRA overhead is base tok/s over adapter tok/s,
less one. `close_s` is how long `LLM.close()` took, and `rank_exit_codes` how the other ranks ended.
`host_us_per_step`: rank 0's host time per step by phase (each kind's last batch), and at TP > 1 its
hand-over of each step to the other ranks (`handover`: encoding and queueing it); every other rank logs
its own, and how long it waited for rank 0, at the end of each batch ("run of N steps", on stderr).
Beside each batch size's numbers, the bytes each kind's batch reads (`tools/roofline.py`: weights and the
adapters' pool rows every step, each sequence's KV), the device's copy bandwidth (probed once, before the
engine starts), and the best adapter/base ratio those bytes allow with the fraction of it measured.
`--device cpu` runs the ranks as CPU processes (gloo), without the roofline: the host time per step of a
rank at TP=1 and TP=2 compared where no GPU is (a shape small enough for the CPU: `--set` of
`tools/make_tiny_model.py`)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from proto.sampling import SamplingParams
from runtime.offline import LLM
from tools import roofline


def _batch(llm: LLM, prompts, adapters, output_len: int) -> tuple[float, list[list[int]]]:
    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
    if llm.runner.device.type == "cuda":
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
    ap.add_argument("--lora-dtype", default="auto", help="the adapter pool's rows: auto (the model's) or fp8")
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--disable-custom-all-reduce", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="auto", help="the model's (auto: the checkpoint's)")
    a = ap.parse_args()
    names = {Path(p).name: p for p in a.adapters}
    cuda = a.device == "cuda"
    bandwidth = roofline.probe_bandwidth("cuda") if cuda else None
    start = time.perf_counter()
    llm = LLM(
        a.model,
        adapters=names,
        device=a.device,
        dtype=a.dtype,
        max_lora_rank=a.max_lora_rank,
        lora_dtype=a.lora_dtype,
        max_running_requests=max(*a.batch, 16),
        tensor_parallel_size=a.tp,
        disable_custom_all_reduce=a.disable_custom_all_reduce,
        prefix_caching=False,  # the rounds repeat the prompts: each must prefill them
    )
    built = time.perf_counter() - start
    model = roofline.ModelBytes.from_dir(a.model)
    step_adapter_bytes = sum(llm.runner.pool.row_nbytes * _rank(p) for p in names.values())
    batches, greedy = {}, {}
    for batch in a.batch:
        runs, tokens = _rounds(llm, a, names, batch)
        if cuda:
            _bound(runs, _bytes_read(a, batch, model, step_adapter_bytes, bandwidth), batch * a.output_len)
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
        "lora_dtype": a.lora_dtype,
        "bandwidth_Bps": bandwidth,
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
    high = min(30000, llm.runner.full_cfg.vocab_size)  # a CPU-sized vocabulary may be smaller
    prompts = [torch.randint(high // 30, high, (a.prompt_len,), generator=g).tolist() for _ in range(batch)]
    mix = [list(names)[i % len(names)] for i in range(batch)] if names else None
    runs: dict[str, list[float]] = {"base": [], "lora": []}
    host: dict[str, dict[str, float]] = {}
    order = ["base", "lora"] + (["base", "lora", "lora", "base"] * a.rounds if mix else ["base"] * a.rounds)
    greedy: dict[str, list[list[int]]] = {}
    handover = _time_handover(llm)
    for i, kind in enumerate(order):
        handover[0] = 0.0
        rate, tokens = _batch(llm, prompts, mix if kind == "lora" else None, a.output_len)
        steps = llm.last_stats.steps
        host[kind] = {k: round(v / steps * 1e6, 1) for k, v in llm.last_phase_seconds.items()}
        if llm.ranks is not None:
            host[kind]["handover"] = round(handover[0] / steps * 1e6, 1)
        greedy.setdefault(kind, tokens)
        if i >= (2 if mix else 1):  # the first of each kind is the warm-up
            runs[kind].append(rate)
    out: dict = {"tok_s": runs, "median_tok_s": {k: statistics.median(v) for k, v in runs.items() if v}}
    out["host_us_per_step"] = host
    if runs["lora"]:
        m = out["median_tok_s"]
        out["lora_overhead"] = m["base"] / m["lora"] - 1
    return out, greedy


def _time_handover(llm: LLM) -> list[float]:
    """[seconds] that rank 0's hand-overs of steps take from now on (its `ranks.launch`, timed)."""
    total = [0.0]
    if llm.ranks is not None:
        launch = llm.ranks.launch

        def timed(plan) -> None:
            start = time.perf_counter()
            launch(plan)
            total[0] += time.perf_counter() - start

        llm.ranks.launch = timed
    return total


def _rank(adapter_dir: str) -> int:
    """The largest rank of a PEFT adapter (the rank rows it takes in the pool)."""
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return max([int(cfg["r"]), *(int(r) for r in (cfg.get("rank_pattern") or {}).values())])


def _bytes_read(a, batch: int, model: roofline.ModelBytes, step_adapter_bytes: int, bandwidth: float) -> dict:
    """One batch's bytes for each kind, per GPU (a rank reads its 1/tp shard of everything): one step a
    token (the prefill of the batch's prompts, then output_len - 1 decode steps)."""
    kv = batch * roofline.kv_tokens_read(a.prompt_len, a.output_len)
    out = {}
    for kind, adapter_bytes in (("base", 0), ("lora", a.output_len * step_adapter_bytes)):
        r = roofline.run_bytes(model, a.output_len, adapter_bytes, kv, bandwidth)
        out[kind] = {k: v / a.tp if k.endswith("_bytes") else v for k, v in r.items()}
        out[kind]["floor_s"] = out[kind]["total_bytes"] / bandwidth
    return out


def _bound(runs: dict, bytes_read: dict, tokens: int) -> None:
    """Add the roofline to one batch size's `runs`: the base's fraction of its bytes floor, and the
    adapter/base ratio the bytes allow with the fraction of it measured."""
    runs["roofline"] = bytes_read
    m = runs["median_tok_s"]
    if m.get("base"):
        runs["base_fraction_of_floor"] = bytes_read["base"]["floor_s"] / (tokens / m["base"])
    if m.get("base") and m.get("lora"):
        base_s = tokens / m["base"]
        bound = roofline.bound_ratio(bytes_read["lora"], tokens, bytes_read["base"], tokens, base_s)
        runs["lora_ratio"] = m["lora"] / m["base"]
        runs["bytes_bound_ratio"] = bound
        runs["fraction_of_bound"] = roofline.fraction_of_bound(runs["lora_ratio"], bound)


if __name__ == "__main__":
    main()
