"""The real Planner over S1's request lists, with no GPU and no step costs (session 12, CPU): does
admission fill the 4 GB pool, or does the batch stop short of it?

S1: 1,000 requests of 256 in and 128 out, all at 0, uniform over 2,000 rank-16 adapters, against the same
over 8 adapters; a 4 GiB pool of 1.41 MB rank rows (the 1B layout), ids as the worker sizes them, 256
running requests at most. Every load completes at once. Printed per run: plans, running requests per plan
(mean, median, 90th percentile) and distinct adapters per plan (mean, 90th percentile).
    python docs/results/session12_cpu_2026-11-26/s1_sim/sim.py   (from the repository root)"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from proto.plan import FinishedRequest, StepResult  # noqa: E402
from proto.sampling import SamplingParams  # noqa: E402
from stages.scheduler.planner import Planner, PlannerConfig  # noqa: E402

ROW = 1.41e6
ROWS = int(4 * 2**30 / ROW)
IDS = min(4096, ROWS // 4)


def run(path: Path, affinity: int) -> dict:
    reqs = [json.loads(line) for line in path.open()]
    cfg = PlannerConfig(
        num_pages=100000, page_size=16, pool_rows=ROWS, pool_ids=IDS, max_lora_rank=16,
        max_loras_per_batch=IDS, max_running_requests=256, max_tokens_per_step=8192, max_model_len=2048,
        overlap_loading=True, prefetch_depth=8, overlap_min_bytes=128 << 20, affinity_steps=affinity,
    )  # fmt: skip
    p = Planner(cfg, adapter_rows=lambda a: 16, clock=lambda: 0.0, load_bytes=lambda a: int(16 * ROW))
    out_len = {}
    for i, r in enumerate(reqs):
        p.add(f"r{i}", [1] * r["input_len"], r["adapter"], SamplingParams(max_tokens=r["max_tokens"]))
        out_len[f"r{i}"] = r["max_tokens"]
    running, distinct = [], []
    while p.has_work:
        plan = p.schedule()
        running.append(len(p.running))
        distinct.append(len({r.adapter for r in p.running if r.adapter}))
        done = [
            FinishedRequest(request_id=r.request_id, reason="length", num_output_tokens=out_len[r.request_id])
            for r in p.running
            if r.num_tokens - len(r.prompt_ids) >= out_len[r.request_id]
        ]
        p.update(StepResult(step=plan.step, finished=done, slots_ready=[x.slot for x in plan.slot_loads]))

    def pct(xs: list[int], f: float) -> int:
        return sorted(xs)[int(f * (len(xs) - 1))]

    return {
        "plans": len(running), "running mean/p50/p90": (round(statistics.mean(running), 1), pct(running, 0.5),
        pct(running, 0.9)), "distinct mean/p90": (round(statistics.mean(distinct), 1), pct(distinct, 0.9)),
    }  # fmt: skip


def main() -> None:
    print(f"pool: {ROWS} rank rows, room for {ROWS // 16} rank-16 adapters")
    g = ["--num-prompts", "1000", "--input-len", "256", "--output-len", "128", "--request-rate", "inf"]
    g += ["--seed", "0"]
    with tempfile.TemporaryDirectory() as d:
        for n in (2000, 8):
            path = Path(d) / f"{n}.jsonl"
            args = [sys.executable, "-m", "tools.workload", "--out", str(path), *g, "--num-adapters", str(n)]
            subprocess.run([*args, "--adapter-distribution", "uniform"], check=True, capture_output=True)
            for affinity in (0, 200):
                print(f"{n:>4} adapters, affinity {affinity:>3}: {run(path, affinity)}", flush=True)


if __name__ == "__main__":
    main()
