"""Host seconds of the warm-up plan (`stages/worker/warmup_plan.py`) on an empty compile cache, for the
cold-start configurations of `run_cold_start_bench.sh` on a Llama-3.2-1B-shaped model: "mixed" (max rank
64, 96 adapters of ranks 8/16/32/64) and "r16" (max rank 16), both with --max-tokens-per-step 8192
--max-running-requests 256 --max-model-len 2048, the default CUDA graphs (decode sizes to 256, step
graphs to 8,192 tokens) and the GPU pool's default size on an H200 (`--pool-gb`). The plan is host work
only: it runs on the CPU, with the SM count and dependent-launch setting of the GPU named by `--sms`
and `--pdl`. Prints one line per configuration (best of `--repeat`); with OUT_DIR, writes
OUT_DIR/warmup_plan.json too.
    python -m benchmarks.bench_warmup_plan [OUT_DIR] [--sms 132] [--pdl 1] [--repeat 3]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kernels import device_info
from runtime.common.lora_layout import LoraLayout
from stages.worker.decode_graphs import batch_buckets
from stages.worker.lora.backend import PADDED_BLOCK_M
from stages.worker.lora.pool import LoraPool, pool_geometry
from stages.worker.lora.triton_backend import TritonLoraBackend
from stages.worker.step_inputs import token_buckets
from stages.worker.warmup_plan import attention_variants, lora_launches

# Llama-3.2-1B: 16 layers, hidden 2048, 32 query and 8 KV heads of 64, intermediate 8192
MODEL = dict(num_layers=16, hidden=2048, q_out=2048, kv_out=512, intermediate=8192)
HEADS, KV_HEADS = 32, 8
CONFIGS = {"mixed": 64, "r16": 16}  # name: --max-lora-rank


def plan_seconds(max_rank: int, a: argparse.Namespace) -> dict:
    layout = LoraLayout.build(**MODEL, max_rank=max_rank)
    _, ids = pool_geometry(layout, torch.bfloat16, int(a.pool_gb * 2**30))
    # The plan reads the pool's id count, widths and row dtype, not its rows: one adapter's rows suffice.
    pool = LoraPool(layout, max_rank, ids, torch.bfloat16, torch.device("cpu"))
    backend = TritonLoraBackend(pool, a.max_tokens, a.max_seqs)
    graph_tokens = min(a.max_tokens, 8192)
    padded = (
        *batch_buckets(min(a.max_seqs, 256)),
        *((b, PADDED_BLOCK_M) for b in token_buckets(graph_tokens)),
    )
    attn = dict(
        num_heads=HEADS, num_kv_heads=KV_HEADS, max_tokens=a.max_tokens, max_seqs=a.max_seqs,
        max_model_len=a.max_model_len, device=torch.device("cpu"),
    )  # fmt: skip
    lora_s, attn_s = [], []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        launches = lora_launches(backend, padded)
        t1 = time.perf_counter()
        variants = attention_variants(**attn)
        t2 = time.perf_counter()
        lora_s.append(t1 - t0)
        attn_s.append(t2 - t1)
    total = [x + y for x, y in zip(lora_s, attn_s, strict=True)]
    return {
        "max_rank": max_rank, "ids": ids, "lora_variants": len(launches), "attention_variants": len(variants),
        "lora_s": min(lora_s), "attention_s": min(attn_s), "total_s": min(total),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", type=Path)
    p.add_argument(
        "--sms", type=int, default=132, help="SM count of the GPU the plan is for (H100/H200: 132)"
    )
    p.add_argument("--pdl", type=int, default=1, help="1: dependent launches (Hopper)")
    p.add_argument("--pool-gb", type=float, default=13.5, help="GPU adapter pool (H200 default: ~13.5 GiB)")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--max-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    # The plan is computed on the CPU here, for the GPU these say (the heuristics read them from device_info).
    saved = device_info.num_sms, device_info.pdl
    device_info.num_sms, device_info.pdl = (lambda device: a.sms), (lambda device: bool(a.pdl))
    results = {}
    try:
        for name, rank in CONFIGS.items():
            r = results[name] = plan_seconds(rank, a)
            print(
                f"{name}: max rank {rank}, {r['ids']} ids: {r['lora_variants']} LoRA + "
                f"{r['attention_variants']} attention variants; plan {r['total_s']:.3f} s (LoRA "
                f"{r['lora_s']:.3f}, attention {r['attention_s']:.3f})"
            )
    finally:
        device_info.num_sms, device_info.pdl = saved
    if a.out_dir is not None:
        a.out_dir.mkdir(parents=True, exist_ok=True)
        (a.out_dir / "warmup_plan.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
