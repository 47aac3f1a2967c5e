"""Host and device time of one tensor-parallel rank's slot load of a rank-16 adapter (`AdapterSharder`,
then `LoraPool.load`), 1B- and 8B-shaped, bf16, against a one-rank pool's load of the whole block: the
shard cut on the device (what a CUDA rank does) and on the host (what a CPU rank does, and what every
rank did before).

python -m benchmarks.bench_tp_shard OUT_DIR [--tp 2] [--iters 30]

Host µs is the step thread's time to issue the load (median); device µs the load's time on the stream
(CUDA events, median), which the first step that uses the adapter waits for. Writes OUT_DIR/tp_shard.json
and prints one line per case."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from runtime.common.lora_layout import NUM_SLICES, LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.common.packed import PackedAdapter
from runtime.synthetic.model import build_config
from stages.worker.lora.pool import LoraPool
from stages.worker.tp.lora_shard import AdapterSharder
from stages.worker.tp.shard import shard_config

RANK = 16


def _case(layout: LoraLayout, sharder: AdapterSharder | None, block: PackedAdapter, iters: int) -> dict:
    device = torch.device("cuda")
    pool = LoraPool(layout, total_rows=4 * RANK, num_ids=4, dtype=torch.bfloat16, device=device)
    host, dev = [], []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        packed = sharder(block) if sharder is not None else block
        pool.load(i % 4, packed, [((i % 4) * RANK, RANK)])
        issued = time.perf_counter() - t
        end.record()
        end.synchronize()
        if i >= 3:
            host.append(issued * 1e6)
            dev.append(start.elapsed_time(end) * 1e3)
    return {"host_us": round(statistics.median(host), 1), "device_us": round(statistics.median(dev), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    results = []
    for preset in ("1b", "8b"):
        cfg = ModelConfig.from_dict(build_config("llama", preset, dtype="bfloat16"))
        whole = LoraLayout.for_model(cfg, RANK)
        part = LoraLayout.for_model(shard_config(cfg, a.tp), RANK)
        g = torch.Generator().manual_seed(0)
        data = torch.randn((cfg.num_layers, RANK, whole.row_elems), generator=g).to(torch.bfloat16)
        ranks = torch.full((cfg.num_layers, NUM_SLICES), RANK, dtype=torch.int32)
        block = PackedAdapter("a", data.pin_memory(), ranks, torch.ones(cfg.num_layers, NUM_SLICES))
        cases = {
            "tp1_whole": (whole, None),
            f"tp{a.tp}_device_cut": (part, AdapterSharder(whole, part, 1, a.tp, device, torch.bfloat16)),
            f"tp{a.tp}_host_cut": (part, AdapterSharder(whole, part, 1, a.tp)),
        }
        for name, (layout, sharder) in cases.items():
            r = {"preset": preset, "case": name, "block_mb": round(data.numel() * 2 / 1e6, 1)}
            r |= _case(layout, sharder, block, a.iters)
            print(json.dumps(r), flush=True)
            results.append(r)
    (a.out / "tp_shard.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
