"""Time of one bf16 all-reduce over two GPUs by each path (NCCL, peer one-shot, peer two-shot) and message
size, replayed from CUDA graphs as the decode steps replay them; says where the cheapest path changes,
beside the thresholds `stages/worker/tp/allreduce.py` uses.

python -m benchmarks.bench_allreduce --out allreduce.json

Each (path, size) cell captures 20 all-reduces in one graph and reports the median over 30 replays of
the time per all-reduce. NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set for both
ranks (no NVLink multicast)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.base.endpoints import free_port
from stages.worker.tp.allreduce import ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES
from stages.worker.tp.group import TPGroup, TPSpec

SIZES_KIB = (8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PER_GRAPH, REPLAYS = 20, 30


def _time_path(group: TPGroup, path: str, t: torch.Tensor) -> float:
    """Microseconds per all-reduce of `t` by `path`."""

    def once() -> torch.Tensor:
        if path == "nccl":
            dist.all_reduce(t)
            return t
        return group.peer.sum(t, path)

    once()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PER_GRAPH):
            once()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier(group=group.control)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / PER_GRAPH)
    return statistics.median(times)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    device = torch.device(f"cuda:{rank}")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True) if rank == 0 else None
    group = TPGroup(TPSpec(rank=rank, size=2, host="127.0.0.1", port=port), device, store)
    assert group.peer is not None, "no peer all-reduce on these GPUs"
    rows = []
    for kib in SIZES_KIB:
        t = torch.randn(kib * 512, device=device).to(torch.bfloat16)  # 512 bf16 per KiB
        cell = {"kib": kib}
        for path in ("nccl", "one_shot", "two_shot"):
            if path != "nccl" and t.nbytes > TWO_SHOT_MAX_BYTES:
                continue
            cell[path] = round(_time_path(group, path, t), 2)
        rows.append(cell)
    if rank == 0:
        Path(out).write_text(json.dumps(rows, indent=1))
    torch.cuda.synchronize()
    group.close(graceful=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    mp.spawn(_rank, args=(free_port(), str(a.out)), nprocs=2)
    rows = json.loads(a.out.read_text())
    print(f"{'KiB':>6} {'nccl us':>8} {'1-shot':>8} {'2-shot':>8}  best   (used: 1-shot <= "
          f"{ONE_SHOT_MAX_BYTES // 1024} KiB, 2-shot <= {TWO_SHOT_MAX_BYTES // 1024} KiB)")  # fmt: skip
    for r in rows:
        best = min((p for p in ("nccl", "one_shot", "two_shot") if p in r), key=lambda p: r[p])
        print(f"{r['kib']:>6} {r['nccl']:>8} {r.get('one_shot', '-'):>8} {r.get('two_shot', '-'):>8}  {best}")


if __name__ == "__main__":
    main()
